"""Ragged slot writes: token t of ``key``/``value`` goes to pool slot ``slot_mapping[t]``.

Slots are arbitrary, so a chunk may start in the middle of a block and span any number of
blocks. A negative slot is padding and is skipped. K and V are written by one launch, cast to
the pools' dtype, or, for quantized pools (``int8``), quantized per
(token, KV head) with their float32 scales written beside them in the same launch
(``kernels._quantize_jit``; K smoothing and channel equalization optional).

K smoothing subtracts a per-(KV head, channel) mean from K before quantizing; channel
equalization then divides each (KV head, channel) of K and V by a factor (``kernels.equalize``).
Given a cache's per-layer flags ``k_smooth_chosen`` and ``equalizers_chosen``, the first write
that finds one unset chooses what it guards from the rows it writes (the mean first, then the
factors of K minus that mean: ``choose_k_mean``, ``choose_equalizers``) and sets it, so each has
one owner: every later write of the layer, through the fused op or a driver of its own,
subtracts the same frozen mean and divides by the same factors, which it regrows first where
its rows are many times wider (``regrow_chosen``, ``kernels.regrow``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_video._removed import refuse_e4m3_pool
from paged_video.kernels import _checks, equalize, quantize, regrow, torch_path, value_channels
from paged_video.kernels._copy_tiles import copy_tiles, plane_is_flat, plane_mask, plane_offsets
from paged_video.kernels._quantize_jit import quantize_rows, round_to_code_grid
from paged_video.kernels._runtime import use_torch_path


@triton.jit
def _slot_offsets(slot, stride_block, stride_slot, POOL_BLOCK: tl.constexpr):
    """Element offsets of pool slots ``slot`` (``block * POOL_BLOCK + offset``) in a pool
    addressed by its blocks' and its slots' strides (keys-major pools, ``kernels.pool_layout``,
    are not a whole number of slots per block apart); a flat pool is one slot per block."""
    if POOL_BLOCK == 1:
        return slot * stride_block
    return slot // POOL_BLOCK * stride_block + slot % POOL_BLOCK * stride_slot


@triton.jit
def _write_slots_kernel(
    key_ptr,
    value_ptr,
    k_pool_ptr,
    v_pool_ptr,
    slot_mapping_ptr,
    num_tokens,
    num_kv_heads,
    head_dim,
    stride_key_tok,
    stride_key_head,
    stride_key_dim,
    stride_value_tok,
    stride_value_head,
    stride_value_dim,
    stride_kp_block,
    stride_kp_slot,
    stride_kp_head,
    stride_kp_dim,
    stride_vp_block,
    stride_vp_slot,
    stride_vp_head,
    stride_vp_dim,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FLAT: tl.constexpr,
    POOL_BLOCK: tl.constexpr,
):
    # Program (t, c) copies plane chunk c of BLOCK_T tokens: K and V are both loaded before
    # either is stored, so the two round trips to memory overlap.
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    chunk = tl.program_id(1)
    t_mask = offs_t < num_tokens
    slot = tl.load(slot_mapping_ptr + offs_t, mask=t_mask, other=-1).to(tl.int64)
    write = t_mask & (slot >= 0)
    real = plane_mask(chunk, num_kv_heads, head_dim, BLOCK_C, BLOCK_D, FLAT)
    mask = write[:, None] & real[None, :]
    tok = offs_t[:, None]
    slot = slot[:, None]

    key_cols = plane_offsets(chunk, stride_key_head, stride_key_dim, BLOCK_C, BLOCK_D, FLAT)
    value_cols = plane_offsets(chunk, stride_value_head, stride_value_dim, BLOCK_C, BLOCK_D, FLAT)
    key = tl.load(key_ptr + tok * stride_key_tok + key_cols[None, :], mask=mask, other=0.0)
    value = tl.load(value_ptr + tok * stride_value_tok + value_cols[None, :], mask=mask, other=0.0)
    kp_cols = plane_offsets(chunk, stride_kp_head, stride_kp_dim, BLOCK_C, BLOCK_D, FLAT)
    vp_cols = plane_offsets(chunk, stride_vp_head, stride_vp_dim, BLOCK_C, BLOCK_D, FLAT)
    kp_slot = _slot_offsets(slot, stride_kp_block, stride_kp_slot, POOL_BLOCK)
    vp_slot = _slot_offsets(slot, stride_vp_block, stride_vp_slot, POOL_BLOCK)
    tl.store(
        k_pool_ptr + kp_slot + kp_cols[None, :], key.to(k_pool_ptr.dtype.element_ty), mask=mask
    )
    tl.store(
        v_pool_ptr + vp_slot + vp_cols[None, :], value.to(v_pool_ptr.dtype.element_ty), mask=mask
    )


@triton.jit
def _write_slots_quantized_kernel(
    key_ptr,
    value_ptr,
    k_pool_ptr,
    v_pool_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_smooth_ptr,
    k_equalizer_ptr,
    v_equalizer_ptr,
    v_channel_ptr,
    saturated_ptr,
    slot_mapping_ptr,
    num_tokens,
    num_kv_heads,
    head_dim,
    stride_key_tok,
    stride_key_head,
    stride_key_dim,
    stride_value_tok,
    stride_value_head,
    stride_value_dim,
    stride_kp_block,
    stride_kp_slot,
    stride_kp_head,
    stride_kp_dim,
    stride_vp_block,
    stride_vp_slot,
    stride_vp_head,
    stride_vp_dim,
    stride_ks_block,
    stride_ks_slot,
    stride_ks_head,
    stride_vs_block,
    stride_vs_slot,
    stride_vs_head,
    stride_sm_head,
    stride_sm_dim,
    stride_keq_head,
    stride_keq_dim,
    stride_veq_head,
    stride_veq_dim,
    stride_vc_block,
    stride_vc_head,
    stride_vc_dim,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SMOOTH: tl.constexpr,
    HAS_K_EQUALIZER: tl.constexpr,
    HAS_V_EQUALIZER: tl.constexpr,
    K_QMAX: tl.constexpr,
    V_QMAX: tl.constexpr,
    POOL_BLOCK: tl.constexpr,
    V_CHANNEL: tl.constexpr,
    CHANNEL_BLOCK: tl.constexpr,
    COUNT_SATURATED: tl.constexpr,
    V_PLAIN: tl.constexpr,
):
    # Program (t, h) quantizes BLOCK_T tokens x BLOCK_H whole heads of K and of V. The tile is
    # 3-D [tokens, heads, BLOCK_D] rather than the copy tiles' flat plane chunk: each scale is
    # the amax of one (token, head) row, which is then a plain reduction over the last axis,
    # and the scales form a [tokens, heads] tile stored as is (no reshape of a distributed
    # tensor, which can cost a trip through shared memory). The geometry is the copy tiles'
    # strided one (whole heads, head_dim padded to a power of two); padding lanes load 0.
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < num_tokens
    slot = tl.load(slot_mapping_ptr + offs_t, mask=t_mask, other=-1).to(tl.int64)
    write = t_mask & (slot >= 0)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dim = tl.arange(0, BLOCK_D)
    plane_mask = (head < num_kv_heads)[:, None] & (dim < head_dim)[None, :]
    row_mask = write[:, None] & (head < num_kv_heads)[None, :]
    mask = write[:, None, None] & plane_mask[None, :, :]
    head = head.to(tl.int64)
    dim = dim.to(tl.int64)
    tok3 = offs_t[:, None, None]
    head3 = head[None, :, None]
    dim3 = dim[None, None, :]

    key = tl.load(
        key_ptr + tok3 * stride_key_tok + head3 * stride_key_head + dim3 * stride_key_dim,
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    value = tl.load(
        value_ptr + tok3 * stride_value_tok + head3 * stride_value_head + dim3 * stride_value_dim,
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    if HAS_SMOOTH:
        smooth = tl.load(
            k_smooth_ptr + head[:, None] * stride_sm_head + dim[None, :] * stride_sm_dim,
            mask=plane_mask,
            other=0.0,
        )
        key = key - smooth[None, :, :]
    # Equalization divides each channel by its factor (padding lanes by 1: they stay 0).
    if HAS_K_EQUALIZER:
        k_factor = tl.load(
            k_equalizer_ptr + head[:, None] * stride_keq_head + dim[None, :] * stride_keq_dim,
            mask=plane_mask,
            other=1.0,
        )
        key = tl.div_rn(key, tl.broadcast_to(k_factor[None, :, :], key.shape))
    if HAS_V_EQUALIZER:
        v_factor = tl.load(
            v_equalizer_ptr + head[:, None] * stride_veq_head + dim[None, :] * stride_veq_dim,
            mask=plane_mask,
            other=1.0,
        )
        value = tl.div_rn(value, tl.broadcast_to(v_factor[None, :, :], value.shape))
    k_codes, k_scale = quantize_rows(key, K_QMAX, False)
    if V_CHANNEL:
        # k8v8: e4m3 codes of V over its (block, head, channel) scales (kernels.value_channels;
        # a frozen tensor's block stride is 0), saturating, the saturated ones counted.
        channel_scale = tl.load(
            v_channel_ptr
            + (slot // CHANNEL_BLOCK)[:, None, None] * stride_vc_block
            + head3 * stride_vc_head
            + dim3 * stride_vc_dim,
            mask=mask,
            other=0.0,
        )
        positive = channel_scale > 0.0
        ratio = tl.div_rn(value, tl.where(positive, channel_scale, 1.0))
        ratio = tl.where(positive, ratio, 0.0)
        if COUNT_SATURATED:
            over = mask & ((tl.abs(ratio) > V_QMAX) | (~positive & (value != 0.0)))
        ratio = tl.minimum(tl.maximum(ratio, -V_QMAX), V_QMAX)
        v_codes = round_to_code_grid(ratio, True)
        if COUNT_SATURATED:
            # A row whose every code is zero while it holds a nonzero value is lost whole (far
            # below the frozen scales: issue 45's v-small): its nonzero elements count too.
            kept = tl.max(tl.where(mask, tl.abs(v_codes), 0.0), axis=2) > 0.0
            over = over | (mask & (value != 0.0) & ~kept[:, :, None])
            tl.atomic_add(saturated_ptr, tl.sum(tl.sum(tl.sum(over.to(tl.int32), 2), 1), 0))
        v_scale = k_scale  # (unused: no V scale per slot)
    elif V_PLAIN:
        v_codes, v_scale = value, k_scale  # k8v16: V as it is (no V scale)
    else:
        v_codes, v_scale = quantize_rows(value, V_QMAX, False)

    kp_slot = _slot_offsets(slot, stride_kp_block, stride_kp_slot, POOL_BLOCK)[:, None, None]
    vp_slot = _slot_offsets(slot, stride_vp_block, stride_vp_slot, POOL_BLOCK)[:, None, None]
    tl.store(
        k_pool_ptr + kp_slot + head3 * stride_kp_head + dim3 * stride_kp_dim,
        k_codes.to(k_pool_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_pool_ptr + vp_slot + head3 * stride_vp_head + dim3 * stride_vp_dim,
        v_codes.to(v_pool_ptr.dtype.element_ty),
        mask=mask,
    )
    ks_slot = _slot_offsets(slot, stride_ks_block, stride_ks_slot, POOL_BLOCK)[:, None]
    vs_slot = _slot_offsets(slot, stride_vs_block, stride_vs_slot, POOL_BLOCK)[:, None]
    head2 = head[None, :]
    tl.store(k_scale_ptr + ks_slot + head2 * stride_ks_head, k_scale, mask=row_mask)
    if not V_CHANNEL and not V_PLAIN:
        tl.store(v_scale_ptr + vs_slot + head2 * stride_vs_head, v_scale, mask=row_mask)


def _check_arguments(
    key: Tensor,
    value: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    k_smooth: Tensor | None,
    k_smooth_chosen: Tensor | None,
    check_values: bool,
    k_equalizer: Tensor | None = None,
    v_equalizer: Tensor | None = None,
    equalizers_chosen: Tensor | None = None,
    v_channel_scale: Tensor | None = None,
) -> None:
    _checks.check_rank("key", key, 3, "(num_tokens, num_kv_heads, head_dim)")
    _checks.check_rank("value", value, 3, "(num_tokens, num_kv_heads, head_dim)")
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        _checks.check_tensor(name, pool)
        if pool.dim() not in (3, 4):
            raise ValueError(
                f"{name} must have rank 3 (num_slots, num_kv_heads, head_dim) or 4 (num_blocks, "
                f"block_size, num_kv_heads, head_dim), got shape {tuple(pool.shape)}"
            )
    _checks.check_rank("slot_mapping", slot_mapping, 1, "(n,)")
    for name, tensor in (("key", key), ("value", value)):
        _checks.check_dtype(name, tensor, _checks.FLOAT_DTYPES)
    # k8v8's V holds e4m3 codes of channel scales; e4m3 beside per-slot scales was deleted.
    refuse_e4m3_pool("k_pool", k_pool.dtype)
    if v_channel_scale is None:
        refuse_e4m3_pool("v_pool", v_pool.dtype)
    for name, tensor in (("k_pool", k_pool), ("v_pool", v_pool)):
        _checks.check_dtype(
            name, tensor, _checks.FLOAT_DTYPES + quantize.QUANT_DTYPES + (quantize.E4M3,)
        )
    _checks.check_dtype("slot_mapping", slot_mapping, _checks.INDEX_DTYPES)
    quantized = quantize.is_quantized(k_pool.dtype)
    # k8v16: int8 K codes beside V stored as it is (no V scale); k8v8 (v_channel_scale): beside
    # e4m3 V, its pools checked by _check_channel_format.
    k8v16 = k_pool.dtype == torch.int8 and v_pool.dtype.is_floating_point and v_scale is None
    mixed = quantize.is_quantized(v_pool.dtype) != quantized
    if mixed and not k8v16 and v_channel_scale is None:
        raise TypeError(
            f"v_pool is {v_pool.dtype} but k_pool is {k_pool.dtype}: both pools must be "
            "quantized or neither"
        )
    quantize.check_scales("k_scale", k_scale, "k_pool", k_pool)
    if v_channel_scale is None:
        quantize.check_scales("v_scale", v_scale, "v_pool", v_pool)
    if k_smooth is not None:
        if not quantized:
            raise ValueError(f"k_smooth is only for quantized pools; k_pool is {k_pool.dtype}")
        _checks.check_tensor("k_smooth", k_smooth)
        _checks.check_dtype("k_smooth", k_smooth, (quantize.SCALE_DTYPE,))
        if k_smooth.shape != k_pool.shape[-2:]:
            raise ValueError(
                f"k_smooth must have shape {tuple(k_pool.shape[-2:])} (num_kv_heads, head_dim), "
                f"got {tuple(k_smooth.shape)}"
            )
    if k_smooth_chosen is not None:
        if k_smooth is None:
            raise ValueError("k_smooth_chosen needs k_smooth (the mean it says is chosen)")
        _checks.check_tensor("k_smooth_chosen", k_smooth_chosen)
        _checks.check_dtype("k_smooth_chosen", k_smooth_chosen, (torch.bool,))
        if k_smooth_chosen.dim() != 0 or k_smooth_chosen.device.type != "cpu":
            raise ValueError(
                "k_smooth_chosen must be a 0-dim bool tensor on the CPU (read without a device "
                f"sync), got shape {tuple(k_smooth_chosen.shape)} on {k_smooth_chosen.device}"
            )
    for name, factor, pool_name, pool in (
        ("k_equalizer", k_equalizer, "k_pool", k_pool),
        ("v_equalizer", v_equalizer, "v_pool", v_pool),
    ):
        if factor is not None and not quantized:
            raise ValueError(f"{name} is only for quantized pools; {pool_name} is {pool.dtype}")
        equalize.check_factor(name, factor, pool_name, pool)
    # (k8v8 pools have no V factors: V's channel scales take what they would; k8v16's V is
    # stored as it is.)
    chosen_factors = {"k_equalizer": k_equalizer}
    if v_channel_scale is None and not k8v16:
        chosen_factors["v_equalizer"] = v_equalizer
    equalize.check_chosen_flag("equalizers_chosen", equalizers_chosen, chosen_factors)
    _checks.check_same_device(
        key=key,
        value=value,
        k_pool=k_pool,
        v_pool=v_pool,
        slot_mapping=slot_mapping,
        k_scale=k_scale,
        v_scale=v_scale,
        k_smooth=k_smooth,
        k_equalizer=k_equalizer,
        v_equalizer=v_equalizer,
    )
    if value.shape != key.shape:
        raise ValueError(
            f"value shape {tuple(value.shape)} must equal key shape {tuple(key.shape)}"
        )
    if v_pool.shape != k_pool.shape:
        raise ValueError(
            f"v_pool shape {tuple(v_pool.shape)} must equal k_pool shape {tuple(k_pool.shape)}"
        )
    _checks.check_head_dim("key", key.shape[2])
    if k_pool.shape[-2:] != key.shape[1:]:
        raise ValueError(
            f"k_pool heads/head_dim {tuple(k_pool.shape[-2:])} must match "
            f"key's {tuple(key.shape[1:])}"
        )
    if slot_mapping.shape[0] > key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for only {key.shape[0]} tokens"
        )
    if k_pool.data_ptr() == v_pool.data_ptr() and k_pool.numel() > 0:
        raise ValueError("k_pool and v_pool must be separate tensors, not the same memory")
    if v_scale is not None and k_scale.data_ptr() == v_scale.data_ptr() and k_scale.numel() > 0:
        raise ValueError("k_scale and v_scale must be separate tensors, not the same memory")
    if check_values and slot_mapping.numel():
        slots = slot_mapping[slot_mapping >= 0]
        num_slots = k_pool.shape[:-2].numel()
        if slots.numel() and int(slots.max()) >= num_slots:
            raise ValueError(
                f"slot_mapping holds slot {int(slots.max())} past the pool's {num_slots} slots"
            )
        if slots.unique().numel() != slots.numel():
            raise ValueError("slot_mapping writes one slot twice; the result would be ambiguous")
    if check_values:
        equalize.check_factor_values("k_equalizer", k_equalizer)
        equalize.check_factor_values("v_equalizer", v_equalizer)


def write_slots(
    key: Tensor,
    value: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    slot_mapping: Tensor,
    *,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    k_smooth: Tensor | None = None,
    k_smooth_chosen: Tensor | None = None,
    k_equalizer: Tensor | None = None,
    v_equalizer: Tensor | None = None,
    equalizers_chosen: Tensor | None = None,
    v_channel_scale: Tensor | None = None,
    v_scale_chosen: Tensor | None = None,
    v_headroom: float = value_channels.V_HEADROOM,
    v_saturated: Tensor | None = None,
    stage_k: Tensor | None = None,
    stage_v: Tensor | None = None,
    regrow_factors: bool = True,
    check_values: bool = True,
) -> None:
    """Write ``key[t]``/``value[t]`` to pool slot ``slot_mapping[t]`` for ``t < len(slot_mapping)``.

    Pools are flat ``(num_slots, num_kv_heads, head_dim)`` views of the paged caches, or the
    paged caches ``(num_blocks, block_size, num_kv_heads, head_dim)`` themselves, slot
    ``block * block_size + offset``, in any layout (keys-major pools, ``kernels.keys_major``,
    have no flat view). Quantized pools (``kernels.quantize.QUANT_DTYPES``: int8; a
    ``float8_e4m3fn`` pool outside k8v8 raises, the e4m3 pool was deleted) take codes, and
    their float32 scales ``k_scale``/``v_scale``, shaped like the pools without head_dim, are
    written with them; ``k_smooth``
    ``(num_kv_heads, head_dim)`` float32 is subtracted from K before quantizing;
    ``k_equalizer``/``v_equalizer`` (the same shape, float32, > 0) then divide each channel of
    K/V (``kernels.equalize``: attention multiplies them back in). With ``k_smooth_chosen``
    (0-dim bool, CPU: a cache's flag, e.g. ``LayerCache.write_kwargs()``), a call that finds it
    False first sets ``k_smooth`` to the mean of the keys it writes (per KV head, over finite
    values of rows with a slot) and sets it True; with ``equalizers_chosen`` likewise, after the
    mean, both factors (``choose_equalizers``).

    The k8v8 format (``v_channel_scale`` given: int8 ``k_pool`` with ``k_scale`` as above, e4m3
    ``v_pool``, no ``v_scale``, no ``v_equalizer``; paged pools): V is stored as codes of its
    float32 scales per (block, KV head, channel), ``v_channel_scale (num_blocks, num_kv_heads,
    head_dim)`` (``kernels.value_channels``): frozen (block stride 0), chosen by the write that
    finds ``v_scale_chosen`` (0-dim bool, CPU) False, or per block, chosen by the write of a
    block's first slot; either from the rows written, times ``v_headroom``. V elements stored
    saturated, and the nonzero elements of a row whose codes all round to zero (lost: far
    below its scales), are added to ``v_saturated`` (int32 ``(1,)``, the pools' device) when
    given.
    A write that finds ``equalizers_chosen`` already set regrows the factors first where its
    own rows are many times wider (``kernels.regrow``: the head's stored codes rescaled, in the
    pools and in ``stage_k``/``stage_v``, staged copies of them, e.g. history staging's);
    ``regrow_factors=False`` leaves that to a caller that did it from more rows
    (``regrow_chosen``: a rank of a sharded window, from every rank's).
    ``check_values=False`` skips the checks that read values (no device sync).
    """
    if v_channel_scale is None and (v_scale_chosen is not None or v_saturated is not None):
        raise ValueError("v_scale_chosen and v_saturated are for v_channel_scale (k8v8) pools")
    _check_arguments(
        key,
        value,
        k_pool,
        v_pool,
        slot_mapping,
        k_scale,
        v_scale,
        k_smooth,
        k_smooth_chosen,
        check_values,
        k_equalizer,
        v_equalizer,
        equalizers_chosen,
        v_channel_scale,
    )
    if v_channel_scale is not None:
        _check_channel_format(
            k_pool, v_pool, k_scale, v_scale, v_equalizer, v_channel_scale, v_scale_chosen,
            v_headroom, v_saturated,
        )  # fmt: skip
    _check_regrowth_arguments(stage_k, stage_v, k_pool, v_pool, regrow_factors)
    slot_mapping = _checks.contiguous_index(slot_mapping)  # the kernel reads it as ptr + t
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    # A write that finds the factors chosen may regrow them; the write that chooses them has
    # nothing to regrow (its own rows chose them).
    factors_were_chosen = equalizers_chosen is not None and bool(equalizers_chosen)
    choose_unset(
        key[:num_tokens],
        value[:num_tokens],
        slot_mapping,
        k_smooth=k_smooth,
        k_smooth_chosen=k_smooth_chosen,
        k_equalizer=k_equalizer,
        v_equalizer=v_equalizer,
        equalizers_chosen=equalizers_chosen,
    )
    if regrow_factors and factors_were_chosen:
        regrow_chosen(
            key[:num_tokens],
            value[:num_tokens],
            slot_mapping,
            k_pool=k_pool,
            v_pool=v_pool,
            k_smooth=k_smooth,
            k_equalizer=k_equalizer,
            v_equalizer=v_equalizer,
            stage_k=stage_k,
            stage_v=stage_v,
        )
    if v_channel_scale is not None:
        _choose_channel_scales(
            value[:num_tokens], slot_mapping, v_pool.shape[1], v_channel_scale, v_scale_chosen,
            v_headroom,
        )  # fmt: skip
    if use_torch_path(key):
        torch_path.write_slots(
            key,
            value,
            k_pool,
            v_pool,
            slot_mapping,
            k_scale,
            v_scale,
            k_smooth,
            k_equalizer,
            v_equalizer,
            v_channel_scale,
            v_saturated,
        )
        return
    if k_scale is not None:
        _launch_quantized(
            key,
            value,
            k_pool,
            v_pool,
            slot_mapping,
            k_scale,
            v_scale,
            k_smooth,
            k_equalizer,
            v_equalizer,
            v_channel_scale,
            v_saturated,
        )
        return
    (k_pool, v_pool), pool_block = _slot_views(k_pool, v_pool)
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    flat = all(plane_is_flat(t) for t in (key, value, k_pool, v_pool))
    tiles = copy_tiles(num_tokens, num_kv_heads, head_dim, flat)
    _write_slots_kernel[tiles.grid(num_tokens)](
        key,
        value,
        k_pool,
        v_pool,
        slot_mapping,
        num_tokens,
        num_kv_heads,
        head_dim,
        *key.stride(),
        *value.stride(),
        *k_pool.stride(),
        *v_pool.stride(),
        **tiles.constexprs(),
        POOL_BLOCK=pool_block,
    )


def choose_unset(
    key: Tensor,
    value: Tensor,
    slot_mapping: Tensor,
    *,
    k_smooth: Tensor | None = None,
    k_smooth_chosen: Tensor | None = None,
    k_equalizer: Tensor | None = None,
    v_equalizer: Tensor | None = None,
    equalizers_chosen: Tensor | None = None,
    v_channel_scale: Tensor | None = None,
    v_scale_chosen: Tensor | None = None,
    v_headroom: float = value_channels.V_HEADROOM,
) -> list[Tensor]:
    """What a write chooses while a layer's flags are unset, in order: the K mean
    (``choose_k_mean``), then the factors from K minus that mean (``choose_equalizers``), then
    k8v8's frozen V channel scales from V (``value_channels.choose_frozen``); each unset flag is
    then set. Returns the flags it set.

    ``write_slots`` calls it with the rows it writes; a caller that writes only part of a
    forward's tokens (one rank of a sharded window) calls it first with every token's rows and
    slots, so the write that follows finds the flags set. The flags are CPU tensors: no sync.
    """
    chosen = []
    if k_smooth_chosen is not None and not bool(k_smooth_chosen):
        choose_k_mean(k_smooth, key, slot_mapping)
        k_smooth_chosen.fill_(True)
        chosen.append(k_smooth_chosen)
    if equalizers_chosen is not None and not bool(equalizers_chosen):
        choose_equalizers(k_equalizer, v_equalizer, key, value, slot_mapping, k_smooth)
        equalizers_chosen.fill_(True)
        chosen.append(equalizers_chosen)
    if v_scale_chosen is not None and not bool(v_scale_chosen):
        value_channels.choose_frozen(v_channel_scale, value, slot_mapping, v_headroom)
        v_scale_chosen.fill_(True)
        chosen.append(v_scale_chosen)
    return chosen


def regrow_chosen(
    key: Tensor,
    value: Tensor,
    slot_mapping: Tensor,
    *,
    k_pool: Tensor,
    v_pool: Tensor,
    k_smooth: Tensor | None = None,
    k_equalizer: Tensor | None = None,
    v_equalizer: Tensor | None = None,
    stage_k: Tensor | None = None,
    stage_v: Tensor | None = None,
) -> None:
    """What a write of a layer whose factors are chosen does before it quantizes: regrow K's
    factors (and an int8 V pool's) where the rows with a slot are many times wider
    (``kernels.regrow``), rescaling the codes of ``k_pool``/``v_pool`` and of the staged
    copies ``stage_k``/``stage_v``. ``write_slots`` calls it with the rows it writes; a caller
    that writes only part of a forward's tokens (one rank of a sharded window) calls it with
    every token's rows and slots (as ``choose_unset``), then writes with
    ``regrow_factors=False``."""
    for factor, rows, pool, staged, share, smooth in (
        (k_equalizer, key, k_pool, stage_k, equalize.K_SHARE, k_smooth),
        (v_equalizer, value, v_pool, stage_v, equalize.V_SHARE, None),
    ):
        # Factors divide only int8 codes with a scale per slot: K of every quantized format,
        # V of the int8 pool (k8v8's V has channel scales, k8v16's is stored as it is).
        if factor is None or pool.dtype != torch.int8:
            continue
        copies = (pool,) if staged is None else (pool, staged)
        regrow.regrow(factor, rows, slot_mapping, share, copies, smooth)


def choose_k_mean(mean: Tensor, key: Tensor, slot_mapping: Tensor) -> None:
    """Set ``mean`` to ``key``'s per KV head, over the finite values of rows with a slot.

    What a write with ``k_smooth_chosen`` unset does, before choosing the factors
    (``choose_unset``).
    """
    keys = key.to(quantize.SCALE_DTYPE)
    used = keys.isfinite() & (slot_mapping >= 0)[:, None, None]
    counts = used.sum(dim=0).clamp_min(1)
    mean.copy_(torch.where(used, keys, 0.0).sum(dim=0) / counts)


def choose_equalizers(
    k_equalizer: Tensor,
    v_equalizer: Tensor | None,
    key: Tensor,
    value: Tensor,
    slot_mapping: Tensor,
    k_smooth: Tensor | None = None,
) -> None:
    """Set the channel equalization factors from the rows with a slot (K minus ``k_smooth``,
    with ``kernels.equalize.K_SHARE``; V with ``V_SHARE``).

    What a write with ``equalizers_chosen`` unset does, after choosing the mean
    (``choose_unset``).
    """
    used = slot_mapping >= 0
    k_equalizer.copy_(equalize.choose_factors(key, k_smooth, used, equalize.K_SHARE))
    if v_equalizer is not None:  # (None: a k8v8 pool's, whose V has channel scales)
        v_equalizer.copy_(equalize.choose_factors(value, None, used, equalize.V_SHARE))


def _slot_views(*pools: Tensor) -> tuple[list[Tensor], int]:
    """``pools`` (codes and scales, all flat or all paged) as paged views the kernels address
    by strides, and their slots per block. Flat pools, and paged ones whose blocks are a whole
    number of slots apart (the cache's slot-major pools), become one slot per block, so they
    share the kernels built for flat pools; others (keys-major) keep their blocks."""
    flat = pools[0].dim() == 3
    if not flat and any(p.stride(0) != p.shape[1] * p.stride(1) for p in pools):
        return list(pools), pools[0].shape[1]
    return [(p if flat else p.flatten(0, 1)).unsqueeze(1) for p in pools], 1


def _launch_quantized(
    key: Tensor,
    value: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor,
    v_scale: Tensor,
    k_smooth: Tensor | None,
    k_equalizer: Tensor | None,
    v_equalizer: Tensor | None,
    v_channel_scale: Tensor | None = None,
    v_saturated: Tensor | None = None,
) -> None:
    """One launch quantizes K and V and writes their codes and scales (k8v8: V's codes of its
    channel scales, no V scale per slot)."""
    block_size = k_pool.shape[1] if k_pool.dim() == 4 else 1
    v_plain = v_scale is None and v_channel_scale is None  # k8v16
    if v_channel_scale is not None or v_plain:
        v_scale = k_scale  # a placeholder, never written with V_CHANNEL or V_PLAIN
    (k_pool, v_pool, k_scale, v_scale), pool_block = _slot_views(k_pool, v_pool, k_scale, v_scale)
    num_tokens = slot_mapping.shape[0]
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    tiles = copy_tiles(num_tokens, num_kv_heads, head_dim, flat=False)
    grid = (triton.cdiv(num_tokens, tiles.block_t), tiles.col_programs)
    has_smooth = k_smooth is not None

    def optional(tensor: Tensor | None) -> tuple[Tensor, tuple[int, int]]:
        """The tensor and its strides, or a placeholder never read (its flag is off)."""
        return (k_scale, (0, 0)) if tensor is None else (tensor, tensor.stride())

    k_equalizer_arg, k_equalizer_strides = optional(k_equalizer)
    v_equalizer_arg, v_equalizer_strides = optional(v_equalizer)
    _write_slots_quantized_kernel[grid](
        key,
        value,
        k_pool,
        v_pool,
        k_scale,
        v_scale,
        k_smooth if has_smooth else k_scale,  # a placeholder, never read without HAS_SMOOTH
        k_equalizer_arg,
        v_equalizer_arg,
        v_channel_scale if v_channel_scale is not None else k_scale,
        v_saturated if v_saturated is not None else slot_mapping,
        slot_mapping,
        num_tokens,
        num_kv_heads,
        head_dim,
        *key.stride(),
        *value.stride(),
        *k_pool.stride(),
        *v_pool.stride(),
        *k_scale.stride(),
        *v_scale.stride(),
        *(k_smooth.stride() if has_smooth else (0, 0)),
        *k_equalizer_strides,
        *v_equalizer_strides,
        *(v_channel_scale.stride() if v_channel_scale is not None else (0, 0, 0)),
        BLOCK_T=tiles.block_t,
        BLOCK_H=tiles.block_c // tiles.block_d,
        BLOCK_D=tiles.block_d,
        HAS_SMOOTH=has_smooth,
        HAS_K_EQUALIZER=k_equalizer is not None,
        HAS_V_EQUALIZER=v_equalizer is not None,
        K_QMAX=quantize.QMAX[k_pool.dtype],
        V_QMAX=quantize.E4M3_MAX
        if v_channel_scale is not None
        else quantize.QMAX.get(v_pool.dtype, 1.0),
        POOL_BLOCK=pool_block,
        V_CHANNEL=v_channel_scale is not None,
        CHANNEL_BLOCK=block_size,
        COUNT_SATURATED=v_saturated is not None,
        V_PLAIN=v_plain,
    )


def _check_regrowth_arguments(
    stage_k: Tensor | None,
    stage_v: Tensor | None,
    k_pool: Tensor,
    v_pool: Tensor,
    regrow_factors: object,
) -> None:
    """``regrow_factors`` is a bool; ``stage_k``/``stage_v``, when given, hold codes of their
    pool's dtype, heads and head_dim, on its device (``(tokens, num_kv_heads, head_dim)``:
    history staging's)."""
    if not isinstance(regrow_factors, bool):
        raise TypeError(f"regrow_factors must be a bool, got {type(regrow_factors).__name__}")
    for name, staged, pool_name, pool in (
        ("stage_k", stage_k, "k_pool", k_pool),
        ("stage_v", stage_v, "v_pool", v_pool),
    ):
        if staged is None:
            continue
        _checks.check_tensor(name, staged)
        if staged.dim() != 3 or staged.shape[1:] != pool.shape[-2:]:
            raise ValueError(
                f"{name} must have shape (tokens, {', '.join(map(str, pool.shape[-2:]))}) "
                f"({pool_name}'s num_kv_heads, head_dim), got {tuple(staged.shape)}"
            )
        if staged.dtype != pool.dtype or staged.device != pool.device:
            raise ValueError(
                f"{name} must hold {pool_name}'s codes ({pool.dtype} on {pool.device}), got "
                f"{staged.dtype} on {staged.device}"
            )


def _check_channel_format(
    k_pool: Tensor,
    v_pool: Tensor,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    v_equalizer: Tensor | None,
    v_channel_scale: Tensor,
    v_scale_chosen: Tensor | None,
    v_headroom: object,
    v_saturated: Tensor | None,
) -> None:
    """The k8v8 write's own arguments (``write_slots``' docstring)."""
    value_channels.check_format(k_pool, v_pool, k_scale, v_scale, v_equalizer, v_channel_scale)
    frozen = value_channels.is_frozen(v_channel_scale)
    if v_scale_chosen is not None:
        if not frozen:
            raise ValueError("v_scale_chosen is for a frozen v_channel_scale (block stride 0)")
        equalize.check_chosen_flag("v_scale_chosen", v_scale_chosen, {})
    if isinstance(v_headroom, bool) or not isinstance(v_headroom, int | float):
        raise TypeError(f"v_headroom must be a number, got {type(v_headroom).__name__}")
    if not 1.0 <= v_headroom < float("inf"):
        raise ValueError(f"v_headroom must be finite and >= 1, got {v_headroom}")
    if v_saturated is not None:
        _checks.check_tensor("v_saturated", v_saturated)
        _checks.check_dtype("v_saturated", v_saturated, (torch.int32,))
        if v_saturated.shape != (1,) or v_saturated.device != v_pool.device:
            raise ValueError(
                f"v_saturated must be int32 of shape (1,) on {v_pool.device}, got shape "
                f"{tuple(v_saturated.shape)} on {v_saturated.device}"
            )
    _checks.check_same_device(v_pool=v_pool, v_channel_scale=v_channel_scale)


def _choose_channel_scales(
    value: Tensor,
    slot_mapping: Tensor,
    block_size: int,
    scales: Tensor,
    chosen: Tensor | None,
    headroom: float,
) -> None:
    """What a k8v8 write chooses before it quantizes: a frozen tensor's scales while its flag
    is unset (then set), a per-block tensor's scales of the blocks whose first slot it
    writes."""
    if value_channels.is_frozen(scales):
        if chosen is not None and not bool(chosen):
            value_channels.choose_frozen(scales, value, slot_mapping, headroom)
            chosen.fill_(True)
    else:
        value_channels.choose_per_block(scales, value, slot_mapping, block_size, headroom)
