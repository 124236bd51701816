"""History staging gather: copy whole cache blocks into contiguous staging buffers.

Entry ``j`` of ``block_ids`` lands at staging rows ``j * block_size .. (j + 1) * block_size - 1``.
Only entries ``j >= first_block`` are copied, so a forward that keeps the staged history can
restage just its own chunk's blocks. Every other staging row is left untouched.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from kernels import _checks, torch_path
from kernels._runtime import interpreter_active, use_torch_path


@triton.jit
def _gather_blocks_kernel(
    k_cache_ptr,
    v_cache_ptr,
    block_ids_ptr,
    stage_k_ptr,
    stage_v_ptr,
    first_block,
    block_size,
    num_kv_heads,
    head_dim,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_kc_dim,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_vc_dim,
    stride_sk_tok,
    stride_sk_head,
    stride_sk_dim,
    stride_sv_tok,
    stride_sv_head,
    stride_sv_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_HD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Program (e, s) copies slots s*BLOCK_S.. of entry first_block + e, every head.
    entry = first_block + tl.program_id(0)
    block = tl.load(block_ids_ptr + entry).to(tl.int64)
    offs_s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    s_mask = offs_s < block_size
    offs_hd = tl.arange(0, BLOCK_HD)
    head = offs_hd // BLOCK_D
    dim = offs_hd % BLOCK_D
    mask = s_mask[:, None] & ((head < num_kv_heads) & (dim < head_dim))[None, :]
    slot = offs_s.to(tl.int64)[:, None]
    row = entry.to(tl.int64) * block_size + slot

    k = tl.load(
        k_cache_ptr
        + block * stride_kc_block
        + slot * stride_kc_slot
        + head[None, :] * stride_kc_head
        + dim[None, :] * stride_kc_dim,
        mask=mask,
        other=0.0,
    )
    tl.store(
        stage_k_ptr
        + row * stride_sk_tok
        + head[None, :] * stride_sk_head
        + dim[None, :] * stride_sk_dim,
        k.to(stage_k_ptr.dtype.element_ty),
        mask=mask,
    )
    v = tl.load(
        v_cache_ptr
        + block * stride_vc_block
        + slot * stride_vc_slot
        + head[None, :] * stride_vc_head
        + dim[None, :] * stride_vc_dim,
        mask=mask,
        other=0.0,
    )
    tl.store(
        stage_v_ptr
        + row * stride_sv_tok
        + head[None, :] * stride_sv_head
        + dim[None, :] * stride_sv_dim,
        v.to(stage_v_ptr.dtype.element_ty),
        mask=mask,
    )


def _check_arguments(
    k_cache: Tensor,
    v_cache: Tensor,
    block_ids: Tensor,
    stage_k: Tensor,
    stage_v: Tensor,
    first_block: int,
    check_values: bool,
) -> None:
    layout = "(num_blocks, block_size, num_kv_heads, head_dim)"
    _checks.check_rank("k_cache", k_cache, 4, layout)
    _checks.check_rank("v_cache", v_cache, 4, layout)
    _checks.check_rank("block_ids", block_ids, 1, "(num_entries,)")
    _checks.check_rank("stage_k", stage_k, 3, "(stage_tokens, num_kv_heads, head_dim)")
    _checks.check_rank("stage_v", stage_v, 3, "(stage_tokens, num_kv_heads, head_dim)")
    _checks.check_same_device(
        k_cache=k_cache, v_cache=v_cache, block_ids=block_ids, stage_k=stage_k, stage_v=stage_v
    )
    for name, tensor in (
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("stage_k", stage_k),
        ("stage_v", stage_v),
    ):
        _checks.check_dtype(name, tensor, _checks.FLOAT_DTYPES)
    _checks.check_dtype("block_ids", block_ids, _checks.INDEX_DTYPES)
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}"
        )
    if stage_v.shape != stage_k.shape:
        raise ValueError(
            f"stage_v shape {tuple(stage_v.shape)} must equal stage_k shape {tuple(stage_k.shape)}"
        )
    _checks.check_head_dim("k_cache", k_cache.shape[3])
    if stage_k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"stage_k heads/head_dim {tuple(stage_k.shape[1:])} must match "
            f"k_cache's {tuple(k_cache.shape[2:])}"
        )
    if isinstance(first_block, bool) or not isinstance(first_block, int):
        raise TypeError(f"first_block must be an int, got {type(first_block).__name__}")
    if not 0 <= first_block <= block_ids.shape[0]:
        raise ValueError(f"first_block must be in 0..{block_ids.shape[0]}, got {first_block}")
    needed = block_ids.shape[0] * k_cache.shape[1]
    if needed > stage_k.shape[0]:
        raise ValueError(
            f"stage_k has {stage_k.shape[0]} rows; {block_ids.shape[0]} blocks of "
            f"{k_cache.shape[1]} need {needed}"
        )
    if check_values and block_ids.shape[0] > first_block:
        copied = block_ids[first_block:]
        if int(copied.min()) < 0 or int(copied.max()) >= k_cache.shape[0]:
            raise ValueError(f"block_ids must lie in 0..{k_cache.shape[0] - 1}")


def gather_blocks(
    k_cache: Tensor,
    v_cache: Tensor,
    block_ids: Tensor,
    stage_k: Tensor,
    stage_v: Tensor,
    *,
    first_block: int = 0,
    check_values: bool = True,
) -> None:
    """Copy blocks ``block_ids[first_block:]`` of both caches into ``stage_k``/``stage_v``.

    ``check_values=False`` skips the block-id range check (no device sync).
    """
    _check_arguments(k_cache, v_cache, block_ids, stage_k, stage_v, first_block, check_values)
    block_ids = _checks.contiguous_index(block_ids)  # the kernel reads it as ptr + entry
    entries = block_ids.shape[0] - first_block
    if entries == 0:
        return
    if use_torch_path(k_cache):
        torch_path.gather_blocks(k_cache, v_cache, block_ids, stage_k, stage_v, first_block)
        return
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    block_d = triton.next_power_of_2(head_dim)
    block_hd = triton.next_power_of_2(num_kv_heads) * block_d
    budget = 1 << 16 if interpreter_active() else 1 << 13
    block_s = max(1, min(triton.next_power_of_2(block_size), budget // block_hd))
    grid = lambda meta: (entries, triton.cdiv(block_size, meta["BLOCK_S"]))
    _gather_blocks_kernel[grid](
        k_cache,
        v_cache,
        block_ids,
        stage_k,
        stage_v,
        first_block,
        block_size,
        num_kv_heads,
        head_dim,
        *k_cache.stride(),
        *v_cache.stride(),
        *stage_k.stride(),
        *stage_v.stride(),
        BLOCK_S=block_s,
        BLOCK_HD=block_hd,
        BLOCK_D=block_d,
    )
