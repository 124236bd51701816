"""Argument checks of ``paged_attention``, shared with the fused op: every error names the
argument at fault, and nothing is written before they pass."""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

from paged_video._removed import refuse_e4m3_pool
from paged_video.kernels import _checks, equalize, quantize, value_channels


def check_arguments(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens_k: Tensor,
    max_seqlen_q: int,
    out: Tensor | None,
    key_limits: Tensor | None,
    key_gap: Tensor | None,
    check_values: bool,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    k_equalizer: Tensor | None = None,
    v_equalizer: Tensor | None = None,
    v_channel_scale: Tensor | None = None,
) -> None:
    _checks.check_rank("q", q, 3, "(total_q, num_heads, head_dim)")
    layout = "(num_blocks, block_size, num_kv_heads, head_dim)"
    _checks.check_rank("k_cache", k_cache, 4, layout)
    _checks.check_rank("v_cache", v_cache, 4, layout)
    _checks.check_rank("block_table", block_table, 2, "(batch, width)")
    _checks.check_rank("cu_seqlens_q", cu_seqlens_q, 1, "(batch + 1,)")
    _checks.check_rank("seq_lens_k", seq_lens_k, 1, "(batch,)")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None:
            _checks.check_tensor(name, scale)
    _checks.check_same_device(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens_k=seq_lens_k,
        out=out,
        key_limits=key_limits,
        key_gap=key_gap,
        k_scale=k_scale,
        v_scale=v_scale,
        k_equalizer=k_equalizer,
        v_equalizer=v_equalizer,
        v_channel_scale=v_channel_scale,
    )
    _checks.check_dtype("q", q, _checks.FLOAT_DTYPES)
    # k8v8's V holds e4m3 codes of channel scales; e4m3 beside per-slot scales was deleted.
    refuse_e4m3_pool("k_cache", k_cache.dtype)
    if v_channel_scale is None:
        refuse_e4m3_pool("v_cache", v_cache.dtype)
    k8v16 = is_k8v16(k_cache, v_cache)
    if v_channel_scale is not None:
        _check_k8v8(k_cache, v_cache, k_scale, v_scale, v_equalizer, v_channel_scale)
    elif k8v16:
        _check_k8v16(q, v_cache, k_scale, v_scale, v_equalizer)
    else:
        _check_cache_dtypes(q, k_cache, v_cache)
    for name, factor, cache_name, cache in (
        ("k_equalizer", k_equalizer, "k_cache", k_cache),
        ("v_equalizer", v_equalizer, "v_cache", v_cache),
    ):
        if factor is not None and not quantize.is_quantized(cache.dtype):
            raise ValueError(f"{name} is only for quantized caches; {cache_name} is {cache.dtype}")
        equalize.check_factor(name, factor, cache_name, cache)
    quantize.check_scales("k_scale", k_scale, "k_cache", k_cache)
    if v_channel_scale is None and not k8v16:
        quantize.check_scales("v_scale", v_scale, "v_cache", v_cache)
    for name, index in (
        ("block_table", block_table),
        ("cu_seqlens_q", cu_seqlens_q),
        ("seq_lens_k", seq_lens_k),
    ):
        _checks.check_dtype(name, index, (torch.int32,))
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    _checks.check_head_dim("q", head_dim)
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache head_dim {k_cache.shape[3]} must equal q head_dim {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"q num_heads {num_heads} must be a multiple of k_cache num_kv_heads {num_kv_heads}"
        )
    batch = block_table.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(
            f"cu_seqlens_q must have shape ({batch + 1},) for a block_table of {batch} rows, "
            f"got {tuple(cu_seqlens_q.shape)}"
        )
    if seq_lens_k.shape[0] != batch:
        raise ValueError(f"seq_lens_k must have shape ({batch},), got {tuple(seq_lens_k.shape)}")
    _checks.check_int("max_seqlen_q", max_seqlen_q, minimum=0)
    if out is not None:
        _checks.check_tensor("out", out)
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(
                f"out must match q: shape {tuple(q.shape)} dtype {q.dtype}, "
                f"got {tuple(out.shape)} {out.dtype}"
            )
    if key_limits is not None:
        _checks.check_rank("key_limits", key_limits, 1, "(total_q,)")
        _checks.check_dtype("key_limits", key_limits, (torch.int32,))
        if key_limits.shape[0] != q.shape[0]:
            raise ValueError(
                f"key_limits must have shape ({q.shape[0]},), got {tuple(key_limits.shape)}"
            )
    if key_gap is not None:
        _checks.check_tensor("key_gap", key_gap)
        _checks.check_dtype("key_gap", key_gap, (torch.int32,))
        if key_gap.dim() not in (2, 3) or key_gap.shape[0] != batch or key_gap.shape[-1] != 2:
            raise ValueError(
                f"key_gap must have shape ({batch}, 2) or ({batch}, gaps, 2), "
                f"got {tuple(key_gap.shape)}"
            )
    if check_values:
        _check_values(q, k_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_q)


def _check_cache_dtypes(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    """Caches in q's dtype, or both in one quantized dtype."""
    if quantize.is_quantized(k_cache.dtype):
        if v_cache.dtype != k_cache.dtype:
            raise TypeError(
                f"v_cache must have k_cache's quantized dtype {k_cache.dtype}, got {v_cache.dtype}"
            )
    else:
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if cache.dtype != q.dtype:
                allowed = ", ".join(str(d) for d in quantize.QUANT_DTYPES)
                raise TypeError(
                    f"{name} must have q's dtype {q.dtype} or a quantized one ({allowed}), "
                    f"got {cache.dtype}"
                )


def is_k8v16(k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether the caches are the k8v16 format's: int8 K codes, V in a float dtype."""
    return k_cache.dtype == torch.int8 and v_cache.dtype.is_floating_point


def _check_k8v16(
    q: Tensor,
    v_cache: Tensor,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    v_equalizer: Tensor | None,
) -> None:
    """The k8v16 format's caches: int8 K with ``k_scale``, V stored as q's dtype, unscaled."""
    if v_cache.dtype != q.dtype:
        raise TypeError(
            f"v_cache beside an int8 k_cache (k8v16) must have q's dtype {q.dtype}, got "
            f"{v_cache.dtype}"
        )
    if k_scale is None:
        raise ValueError("an int8 k_cache with a float v_cache (k8v16) needs k_scale")
    if v_scale is not None or v_equalizer is not None:
        raise ValueError(
            "a float v_cache (k8v16) is stored unscaled: pass no v_scale or v_equalizer"
        )


def _check_k8v8(
    k_cache: Tensor,
    v_cache: Tensor,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    v_equalizer: Tensor | None,
    v_channel_scale: Tensor,
) -> None:
    """The k8v8 format's caches: int8 K with ``k_scale``, e4m3 V with its channel scales only."""
    value_channels.check_format(
        k_cache, v_cache, k_scale, v_scale, v_equalizer, v_channel_scale, ("k_cache", "v_cache")
    )


def _check_values(
    q: Tensor,
    k_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens_k: Tensor,
    max_seqlen_q: int,
) -> None:
    """Checks that read tensor values (one device sync); the fused op skips them."""
    starts = cu_seqlens_q.tolist()
    if starts[0] != 0 or starts[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens_q must run from 0 to total_q={q.shape[0]}, got {starts}")
    q_lens = [b - a for a, b in itertools.pairwise(starts)]
    if any(length < 0 for length in q_lens):
        raise ValueError(f"cu_seqlens_q must be non-decreasing, got {starts}")
    if q_lens and max(q_lens) > max_seqlen_q:
        raise ValueError(f"max_seqlen_q={max_seqlen_q} is below the longest query {max(q_lens)}")
    lengths = seq_lens_k.tolist()
    if any(length < 0 for length in lengths):
        raise ValueError(f"seq_lens_k must be >= 0, got {lengths}")
    block_size = k_cache.shape[1]
    needed = max((math.ceil(length / block_size) for length in lengths), default=0)
    if needed > block_table.shape[1]:
        raise ValueError(
            f"block_table width {block_table.shape[1]} is too narrow: seq_lens_k needs {needed} "
            f"blocks of {block_size}"
        )
    for row, length in enumerate(lengths):
        used = block_table[row, : math.ceil(length / block_size)]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= k_cache.shape[0]):
            raise ValueError(
                f"block_table row {row} points outside the cache's {k_cache.shape[0]} blocks"
            )
