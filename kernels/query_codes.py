"""Query rows as int8 codes: each (token, head) row of ``q`` as int8 codes and a float32 scale
(k8v8, k8v16), made before the attention kernel, which then loads them.

Int8 rows take a scale per row (``amax / 127``, rounded as ``write_slots`` rounds), not one per
block of rows as SageAttention does: the kernel folds each row's scale into the per-row factor
of its softmax either way (no instruction more), and a row's own scale is never coarser.

Why a pass of its own: Triton's Hopper MMA takes its A operand from shared memory (by
descriptor) only when that operand is loaded. Rows the attention kernel rounded itself stayed a
register operand, read back from shared memory every key tile (four ``ldmatrix`` and their
addresses), and at the 128-key TMA loop over keys-major pools ptxas spilled there (Triton 3.6:
16-20 bytes at block 256, with three local loads per tile). Loaded, the codes feed the MMA as K
does. The pass reads q once and writes a byte per element and a scale per row (not yet timed
on a GPU: the sweep's k8v8 and k8v16 rows time it with the attention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_video.kernels._quantize_jit import quantize_rows

ROWS_PER_PROGRAM = 64


@triton.heuristics({"HAS_EQUALIZER": lambda args: args["equalizer_ptr"] is not None})
@triton.jit
def _int8_query_rows_kernel(
    q_ptr,
    equalizer_ptr,
    codes_ptr,
    scales_ptr,
    rows,
    heads,
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    stride_eq_head,
    stride_eq_dim,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_EQUALIZER: tl.constexpr,
):
    """Rows ``r`` = token * heads + head of a program: codes ``q / scale`` and ``scale = amax /
    127`` (a zero row: scale 0, codes 0)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_mask = offs_r < rows
    mask = r_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    token = (offs_r // heads).to(tl.int64)
    head = offs_r % heads
    q = tl.load(
        q_ptr
        + token[:, None] * stride_q_tok
        + head[:, None].to(tl.int64) * stride_q_head
        + offs_d[None, :] * stride_q_dim,
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    if HAS_EQUALIZER:
        # K was stored divided by its KV head's channel factors: q times them keeps every q.k.
        factor = tl.load(
            equalizer_ptr
            + (head // GROUP)[:, None] * stride_eq_head
            + offs_d[None, :] * stride_eq_dim,
            mask=mask,
            other=1.0,
        )
        q = q * factor
    codes, scale = quantize_rows(q, 127.0, False)
    codes = codes.to(tl.int8)
    rows_i64 = offs_r.to(tl.int64)
    tl.store(codes_ptr + rows_i64[:, None] * HEAD_DIM + offs_d[None, :], codes, mask=mask)
    tl.store(scales_ptr + rows_i64, scale, mask=r_mask)


def int8_query_rows(
    q: Tensor, k_equalizer: Tensor | None, heads_per_kv_head: int
) -> tuple[Tensor, Tensor]:
    """``(codes, scales)``: contiguous int8 codes shaped like ``q (total_q, H, D)`` and float32
    scales ``(total_q, H)``, with ``codes * scale`` the row ``q * k_equalizer`` (of its KV head,
    ``heads_per_kv_head`` query heads each) rounded: ``scale = amax / 127``, codes ``q / scale``
    rounded to the nearest integer (ties to even; a zero row: scale 0, codes 0). The launcher's
    checks have run: nothing is checked here."""
    tokens, heads, head_dim = q.shape
    codes = torch.empty(q.shape, dtype=torch.int8, device=q.device)
    scales = torch.empty((tokens, heads), dtype=torch.float32, device=q.device)
    rows = tokens * heads
    equalizer_strides = k_equalizer.stride() if k_equalizer is not None else (0, 0)
    grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_R"]),)
    _int8_query_rows_kernel[grid](
        q,
        k_equalizer,
        codes,
        scales,
        rows,
        heads,
        *q.stride(),
        *equalizer_strides,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_R=ROWS_PER_PROGRAM,
        GROUP=heads_per_kv_head,
        num_warps=4,
    )
    return codes, scales
