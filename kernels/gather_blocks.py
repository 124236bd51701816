"""History staging gather: copy whole cache blocks into contiguous staging buffers.

Entry ``j`` of ``block_ids`` lands at staging rows ``j * block_size .. (j + 1) * block_size - 1``.
Only entries ``j >= first_block`` are copied, so a forward that keeps the staged history can
restage just its own chunk's blocks. Every other staging row is left untouched. Quantized
caches stage their codes bit for bit (as bytes) and their scales beside them, in one launch.
The k8v8 and k8v16 formats (int8 K; V as e4m3 codes of channel scales the caller holds, or as
it is) stage K's codes and scales and V's codes (or values) alone, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_video._removed import refuse_e4m3_pool
from paged_video.kernels import _checks, quantize, torch_path
from paged_video.kernels._copy_tiles import copy_tiles, plane_is_flat, plane_mask, plane_offsets
from paged_video.kernels._runtime import use_torch_path


@triton.jit
def _gather_blocks_kernel(
    k_cache_ptr,
    v_cache_ptr,
    block_ids_ptr,
    stage_k_ptr,
    stage_v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stage_k_scale_ptr,
    stage_v_scale_ptr,
    first_row,
    end_row,
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
    stride_ks_block,
    stride_ks_slot,
    stride_ks_head,
    stride_vs_block,
    stride_vs_slot,
    stride_vs_head,
    stride_sks_tok,
    stride_sks_head,
    stride_svs_tok,
    stride_svs_head,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FLAT: tl.constexpr,
    BLOCK_HS: tl.constexpr,
    K_SCALES: tl.constexpr,
    V_SCALES: tl.constexpr,
):
    # Program (r, c) copies plane chunk c of BLOCK_T staging rows from first_row on; staging
    # row i is slot i % block_size of block block_ids[i // block_size]. Rows run across block
    # edges, so any block size fills whole tiles. K and V are loaded before either is stored.
    # One int64 division per program; per row, an int32 one within the tile's span.
    start = first_row + tl.program_id(0).to(tl.int64) * BLOCK_T
    first_entry = start // block_size
    local = (start - first_entry * block_size).to(tl.int32) + tl.arange(0, BLOCK_T)
    row = start + tl.arange(0, BLOCK_T)
    r_mask = row < end_row
    entry = first_entry + local // block_size
    block = tl.load(block_ids_ptr + entry, mask=r_mask, other=0).to(tl.int64)[:, None]
    slot = (local % block_size).to(tl.int64)[:, None]
    chunk = tl.program_id(1)
    real = plane_mask(chunk, num_kv_heads, head_dim, BLOCK_C, BLOCK_D, FLAT)
    mask = r_mask[:, None] & real[None, :]
    row = row[:, None]

    kc_cols = plane_offsets(chunk, stride_kc_head, stride_kc_dim, BLOCK_C, BLOCK_D, FLAT)
    vc_cols = plane_offsets(chunk, stride_vc_head, stride_vc_dim, BLOCK_C, BLOCK_D, FLAT)
    k = tl.load(
        k_cache_ptr + block * stride_kc_block + slot * stride_kc_slot + kc_cols[None, :],
        mask=mask,
        other=0.0,
    )
    v = tl.load(
        v_cache_ptr + block * stride_vc_block + slot * stride_vc_slot + vc_cols[None, :],
        mask=mask,
        other=0.0,
    )
    sk_cols = plane_offsets(chunk, stride_sk_head, stride_sk_dim, BLOCK_C, BLOCK_D, FLAT)
    sv_cols = plane_offsets(chunk, stride_sv_head, stride_sv_dim, BLOCK_C, BLOCK_D, FLAT)
    tl.store(
        stage_k_ptr + row * stride_sk_tok + sk_cols[None, :],
        k.to(stage_k_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        stage_v_ptr + row * stride_sv_tok + sv_cols[None, :],
        v.to(stage_v_ptr.dtype.element_ty),
        mask=mask,
    )
    if K_SCALES:
        # Quantized caches: the programs of plane chunk 0 also copy their rows' scales, all
        # heads at once (a [BLOCK_T, BLOCK_HS] float32 tile), in the same launch; V's only
        # where V has a scale per slot (not k8v8's channel scales or k8v16's values).
        heads = tl.arange(0, BLOCK_HS)
        scale_heads = tl.where(chunk == 0, num_kv_heads, 0)
        s_mask = r_mask[:, None] & (heads < scale_heads)[None, :]
        heads = heads.to(tl.int64)[None, :]
        k_s = tl.load(
            k_scale_ptr + block * stride_ks_block + slot * stride_ks_slot + heads * stride_ks_head,
            mask=s_mask,
            other=0.0,
        )
        if V_SCALES:
            v_s = tl.load(
                v_scale_ptr
                + block * stride_vs_block
                + slot * stride_vs_slot
                + heads * stride_vs_head,
                mask=s_mask,
                other=0.0,
            )
            tl.store(
                stage_v_scale_ptr + row * stride_svs_tok + heads * stride_svs_head,
                v_s,
                mask=s_mask,
            )
        tl.store(
            stage_k_scale_ptr + row * stride_sks_tok + heads * stride_sks_head, k_s, mask=s_mask
        )


def _check_dtypes(
    k_cache: Tensor,
    v_cache: Tensor,
    stage_k: Tensor,
    stage_v: Tensor,
    scales: dict[str, Tensor | None],
) -> None:
    """Float caches stage into any float dtype; quantized ones into their own, with scales;
    int8 K beside e4m3 or float V with no V scales (k8v8, k8v16) into their own, K's scales
    beside them."""
    # k8v8's V holds e4m3 codes (no V scales); e4m3 beside per-slot scales was deleted.
    refuse_e4m3_pool("k_cache", k_cache.dtype)
    if scales["v_scale"] is not None or scales["stage_v_scale"] is not None:
        refuse_e4m3_pool("v_cache", v_cache.dtype)
    for name, tensor in (("k_cache", k_cache), ("v_cache", v_cache)):
        _checks.check_dtype(
            name, tensor, _checks.FLOAT_DTYPES + quantize.QUANT_DTYPES + (quantize.E4M3,)
        )
    quantized = quantize.is_quantized(k_cache.dtype)
    v_unscaled = _v_unscaled(k_cache, v_cache, scales)
    # e4m3 V holds codes too: k8v8's, beside int8 K only.
    v_codes = quantize.is_quantized(v_cache.dtype) or v_cache.dtype == quantize.E4M3
    if v_codes != quantized and not v_unscaled:
        raise TypeError(
            f"v_cache is {v_cache.dtype} but k_cache is {k_cache.dtype}: both caches must be "
            "quantized or neither (or int8 K beside V with no v_scale: k8v16)"
        )
    for name, stage, cache in (("stage_k", stage_k, k_cache), ("stage_v", stage_v, v_cache)):
        allowed = (cache.dtype,) if quantized else _checks.FLOAT_DTYPES
        _checks.check_dtype(name, stage, allowed)
    quantize.check_scales("k_scale", scales["k_scale"], "k_cache", k_cache)
    quantize.check_scales("stage_k_scale", scales["stage_k_scale"], "stage_k", stage_k)
    if not v_unscaled:
        quantize.check_scales("v_scale", scales["v_scale"], "v_cache", v_cache)
        quantize.check_scales("stage_v_scale", scales["stage_v_scale"], "stage_v", stage_v)


def _v_unscaled(k_cache: Tensor, v_cache: Tensor, scales: dict[str, Tensor | None]) -> bool:
    """Whether V is k8v8's (e4m3 codes of channel scales) or k8v16's (float): int8 K codes
    beside such a V, and no V scales given."""
    v_kind = v_cache.dtype == quantize.E4M3 or v_cache.dtype in _checks.FLOAT_DTYPES
    no_v_scales = scales["v_scale"] is None and scales["stage_v_scale"] is None
    return k_cache.dtype == torch.int8 and v_kind and no_v_scales


def _check_arguments(
    k_cache: Tensor,
    v_cache: Tensor,
    block_ids: Tensor,
    stage_k: Tensor,
    stage_v: Tensor,
    scales: dict[str, Tensor | None],
    first_block: int,
    check_values: bool,
) -> None:
    layout = "(num_blocks, block_size, num_kv_heads, head_dim)"
    _checks.check_rank("k_cache", k_cache, 4, layout)
    _checks.check_rank("v_cache", v_cache, 4, layout)
    _checks.check_rank("block_ids", block_ids, 1, "(num_entries,)")
    _checks.check_rank("stage_k", stage_k, 3, "(stage_tokens, num_kv_heads, head_dim)")
    _checks.check_rank("stage_v", stage_v, 3, "(stage_tokens, num_kv_heads, head_dim)")
    _check_dtypes(k_cache, v_cache, stage_k, stage_v, scales)
    _checks.check_dtype("block_ids", block_ids, _checks.INDEX_DTYPES)
    _checks.check_same_device(
        k_cache=k_cache,
        v_cache=v_cache,
        block_ids=block_ids,
        stage_k=stage_k,
        stage_v=stage_v,
        **scales,
    )
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
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    stage_k_scale: Tensor | None = None,
    stage_v_scale: Tensor | None = None,
    first_block: int = 0,
    check_values: bool = True,
) -> None:
    """Copy blocks ``block_ids[first_block:]`` of both caches into ``stage_k``/``stage_v``.

    Quantized caches stage into buffers of their own dtype (codes copied bit for bit), and
    their scales ``k_scale``/``v_scale`` ``(num_blocks, block_size, num_kv_heads)`` into
    ``stage_k_scale``/``stage_v_scale`` ``(stage_tokens, num_kv_heads)`` beside them. An int8
    K cache beside an e4m3 (k8v8) or float (k8v16) V cache takes no V scales: V's codes or
    values are staged as they are (k8v8's channel scales are the caller's to pass attention).
    ``check_values=False`` skips the block-id range check (no device sync).
    """
    scales = {
        "k_scale": k_scale,
        "v_scale": v_scale,
        "stage_k_scale": stage_k_scale,
        "stage_v_scale": stage_v_scale,
    }
    _check_arguments(
        k_cache, v_cache, block_ids, stage_k, stage_v, scales, first_block, check_values
    )
    block_ids = _checks.contiguous_index(block_ids)  # the kernel reads it as ptr + entry
    entries = block_ids.shape[0] - first_block
    if entries == 0:
        return
    if use_torch_path(k_cache):
        torch_path.gather_blocks(
            k_cache, v_cache, block_ids, stage_k, stage_v, first_block, *scales.values()
        )
        return
    k_scales, v_scales = k_scale is not None, v_scale is not None
    # k8v8's e4m3 V codes are copied as bytes: bit for bit whatever they hold, NaN codes too.
    if v_cache.dtype == quantize.E4M3:
        v_cache, stage_v = v_cache.view(torch.uint8), stage_v.view(torch.uint8)
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    flat = all(plane_is_flat(t) for t in (k_cache, v_cache, stage_k, stage_v))
    rows = entries * block_size
    tiles = copy_tiles(rows, num_kv_heads, head_dim, flat)
    grid = (triton.cdiv(rows, tiles.block_t), tiles.col_programs)
    # Scales not given: their pointers are placeholders, never read or written.
    scale_ptrs = [k_cache if t is None else t for t in scales.values()]
    _gather_blocks_kernel[grid](
        k_cache,
        v_cache,
        block_ids,
        stage_k,
        stage_v,
        *scale_ptrs,
        first_block * block_size,
        block_ids.shape[0] * block_size,
        block_size,
        num_kv_heads,
        head_dim,
        *k_cache.stride(),
        *v_cache.stride(),
        *stage_k.stride(),
        *stage_v.stride(),
        *(k_scale.stride() if k_scales else (0, 0, 0)),
        *(v_scale.stride() if v_scales else (0, 0, 0)),
        *(stage_k_scale.stride() if k_scales else (0, 0)),
        *(stage_v_scale.stride() if v_scales else (0, 0)),
        **tiles.constexprs(),
        BLOCK_HS=triton.next_power_of_2(num_kv_heads),
        K_SCALES=k_scales,
        V_SCALES=v_scales,
    )
