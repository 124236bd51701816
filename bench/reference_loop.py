"""A plain Triton flash-attention loop on contiguous K/V: the yardstick of `bench compile`.

No block table, no masks in the key loop (the key count is a multiple of the key tile), the
softmax scale folded into one FFMA, as in Triton's fused-attention tutorial. The compile report
builds it with the same tiles, warps and stages as ``paged_attention`` and compares the two key
loops. It is compiled, never launched, so it has no Python launcher.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def reference_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    scale_log2,
    q_len,
    k_len,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_o_tok,
    stride_o_head,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (query tile, head) per program; ``k_len`` must be a multiple of ``BLOCK_N``.

    ``BLOCK_D`` is ``HEAD_DIM`` rounded up to a power of two (dimensions past it are masked)."""
    tile_m = tl.program_id(0)
    head = tl.program_id(1)
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d[None, :] < HEAD_DIM
    m_mask = offs_m < q_len
    q = tl.load(
        q_ptr
        + offs_m.to(tl.int64)[:, None] * stride_q_tok
        + head * stride_q_head
        + offs_d[None, :],
        mask=m_mask[:, None] & d_mask,
        other=0.0,
    )
    k_base = k_ptr + head * stride_k_head + offs_n[:, None] * stride_k_tok + offs_d[None, :]
    v_base = v_ptr + head * stride_v_head + offs_n[:, None] * stride_v_tok + offs_d[None, :]
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n_start in range(0, k_len, BLOCK_N):
        rows = n_start.to(tl.int64)
        if HEAD_DIM == BLOCK_D:
            k = tl.load(k_base + rows * stride_k_tok)
            v = tl.load(v_base + rows * stride_v_tok)
        else:
            k = tl.load(k_base + rows * stride_k_tok, mask=d_mask, other=0.0)
            v = tl.load(v_base + rows * stride_v_tok, mask=d_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1) * scale_log2)
        probs = tl.math.exp2(scores * scale_log2 - new_max[:, None])
        rescale = tl.math.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v)
        row_max = new_max
    out = acc / row_sum[:, None]
    tl.store(
        out_ptr
        + offs_m.to(tl.int64)[:, None] * stride_o_tok
        + head * stride_o_head
        + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask,
    )
