"""The fused write+attend op: one ``torch.library`` custom op per attention layer call.

It writes the current video (and action) K/V into the paged pools with ``write_slots`` and then
attends, either straight over the paged cache or, with history staging, after
``gather_blocks`` restages the window into contiguous buffers. Being one opaque op, a compiled
transformer block stays one graph (``fullgraph=True``).

Why the odd-looking choices:

* The pools of every layer are one stacked tensor and the layer index is a 0-dim CPU tensor,
  so one compiled graph serves every layer: a Python int would be specialised per value.
* The first block to restage is a 0-dim CPU tensor for the same reason (-1: no staging), and
  so is the id of the history the forward stages (``stage_key``).
* What each layer's staging buffers hold is recorded here, by the code that writes them, in
  ``stage_tags`` (int64, CPU, one id per layer): a layer restages from ``stage_from`` only when
  its tag is the forward's ``stage_key``, else from block 0, and its tag becomes the key once
  the restage is done. Attending without staging sets the tag to -1 (nothing reusable), as does
  a call that fails part way, so no later forward keeps rows that nothing filled.
* Every argument is checked before the first write: a refused call leaves the pools, the
  staging buffers and the tags as they were, and names the argument as the caller wrote it.
* Mutable arguments have no default values: older PyTorch strips trailing defaults before its
  mutation handlers index the arguments.
* Registration is guarded, so re-importing (or reloading) this module does not raise.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kernels import _checks
from kernels.gather_blocks import gather_blocks
from kernels.paged_attention import _check_arguments as check_attention_arguments
from kernels.paged_attention import paged_attention
from kernels.write_slots import write_slots

NAMESPACE = "paged_video"
OP_NAME = "write_attend"
QUALIFIED_NAME = f"{NAMESPACE}::{OP_NAME}"
MUTATED_ARGS = ("k_pools", "v_pools", "stage_k", "stage_v", "stage_tags")
NOTHING_STAGED = -1


class LayerInputs(NamedTuple):
    """Per-forward inputs of the fused op, shared by every layer but ``layer``.

    ``key_gap`` is ``(rows, 2)`` or ``(rows, gaps, 2)`` int32 of hidden key ranges, or None;
    ``stage_from`` is the first block-table entry to restage when the layer's staging buffers
    hold the history ``stage_key`` names (any other layer restages all), or -1 to attend
    without staging; ``stage_tags`` is the cache's record of what each layer's buffers hold.
    """

    layer: Tensor
    video_slots: Tensor
    action_slots: Tensor
    block_table: Tensor
    cu_seqlens_q: Tensor
    seq_lens_k: Tensor
    key_gap: Tensor | None
    stage_from: Tensor
    stage_key: Tensor
    stage_tags: Tensor
    max_seqlen_q: int
    softmax_scale: float


def _check_scalar(name: str, value: object) -> int:
    """A 0-dim integer CPU tensor (read without a device sync) as an int."""
    _checks.check_tensor(name, value)
    if value.dim() != 0 or value.device.type != "cpu" or value.is_floating_point():
        raise ValueError(
            f"{name} must be a 0-dim integer tensor on the CPU, got shape {tuple(value.shape)} "
            f"{value.dtype} on {value.device}"
        )
    return int(value)


def _check_inputs(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    action_key: Tensor,
    action_value: Tensor,
    k_pools: Tensor,
    v_pools: Tensor,
    stage_k: Tensor,
    stage_v: Tensor,
    layer: Tensor,
    video_slots: Tensor,
    action_slots: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens_k: Tensor,
    key_gap: Tensor | None,
    stage_from: Tensor,
    stage_key: Tensor,
    stage_tags: Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
) -> tuple[int, int]:
    """Check every argument before the first write; returns ``(layer, stage_from)`` as ints.

    The kernels check their own arguments again, under their own names; by then nothing they
    check can fail, so no call writes half its work.
    """
    pools = "(layers, num_blocks, block_size, num_kv_heads, head_dim)"
    _checks.check_rank("k_pools", k_pools, 5, pools)
    _checks.check_rank("v_pools", v_pools, 5, pools)
    if v_pools.shape != k_pools.shape:
        raise ValueError(
            f"v_pools shape {tuple(v_pools.shape)} must equal k_pools shape {tuple(k_pools.shape)}"
        )
    if k_pools.data_ptr() == v_pools.data_ptr() and k_pools.numel() > 0:
        raise ValueError("k_pools and v_pools must be separate tensors, not the same memory")
    num_layers, _, block_size, num_kv_heads, head_dim = k_pools.shape
    layer_index = _check_scalar("layer", layer)
    if not 0 <= layer_index < num_layers:
        raise ValueError(
            f"layer must be in 0..{num_layers - 1} (the pools' layers), got {layer_index}"
        )
    first_block = _check_scalar("stage_from", stage_from)
    _check_scalar("stage_key", stage_key)
    _checks.check_rank("stage_tags", stage_tags, 1, "(layers,)")
    _checks.check_dtype("stage_tags", stage_tags, (torch.int64,))
    if stage_tags.shape[0] != num_layers or stage_tags.device.type != "cpu":
        raise ValueError(
            f"stage_tags must be a CPU tensor of shape ({num_layers},), got "
            f"{tuple(stage_tags.shape)} on {stage_tags.device}"
        )
    kv = "(num_tokens, num_kv_heads, head_dim)"
    for name, tensor in (
        ("key", key),
        ("value", value),
        ("action_key", action_key),
        ("action_value", action_value),
    ):
        _checks.check_rank(name, tensor, 3, kv)
        _checks.check_dtype(name, tensor, _checks.FLOAT_DTYPES)
        if tensor.shape[1:] != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must have shape (num_tokens, {num_kv_heads}, {head_dim}) (the pools' "
                f"num_kv_heads, head_dim), got {tuple(tensor.shape)}"
            )
    for name, tensor, slots_name, slots in (
        ("key", key, "video_slots", video_slots),
        ("action_key", action_key, "action_slots", action_slots),
    ):
        _checks.check_rank(slots_name, slots, 1, "(num_tokens,)")
        _checks.check_dtype(slots_name, slots, _checks.INDEX_DTYPES)
        if tensor.shape[0] != slots.shape[0]:
            raise ValueError(
                f"{name} must have one row per entry of {slots_name} ({slots.shape[0]}), "
                f"got {tensor.shape[0]}"
            )
    for name, tensor, like_name, like in (
        ("value", value, "key", key),
        ("action_value", action_value, "action_key", action_key),
    ):
        if tensor.shape != like.shape:
            raise ValueError(
                f"{name} shape {tuple(tensor.shape)} must equal {like_name} shape "
                f"{tuple(like.shape)}"
            )
    _checks.check_rank("query", query, 3, "(num_tokens, num_heads, head_dim)")
    _checks.check_dtype("query", query, _checks.FLOAT_DTYPES)
    if query.shape[0] != key.shape[0] or query.shape[2] != head_dim:
        raise ValueError(
            f"query must have shape ({key.shape[0]}, num_heads, {head_dim}) (one row per video "
            f"token, the pools' head_dim), got {tuple(query.shape)}"
        )
    if query.shape[1] % num_kv_heads:
        raise ValueError(
            f"query num_heads {query.shape[1]} must be a multiple of num_kv_heads {num_kv_heads}"
        )
    for name, tensor in (("k_pools", k_pools), ("v_pools", v_pools)):
        if tensor.dtype != query.dtype:
            raise TypeError(f"{name} must have query's dtype {query.dtype}, got {tensor.dtype}")
    _checks.check_same_device(
        query=query,
        key=key,
        value=value,
        action_key=action_key,
        action_value=action_value,
        k_pools=k_pools,
        v_pools=v_pools,
        stage_k=stage_k,
        stage_v=stage_v,
        video_slots=video_slots,
        action_slots=action_slots,
        block_table=block_table,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens_k=seq_lens_k,
        key_gap=key_gap,
    )
    _checks.check_softmax_scale(softmax_scale)
    k_cache, v_cache = k_pools[layer_index], v_pools[layer_index]
    check_attention_arguments(
        query,
        k_cache,
        v_cache,
        block_table,
        cu_seqlens_q,
        seq_lens_k,
        max_seqlen_q,
        None,
        None,
        key_gap,
        False,
    )
    if first_block >= 0:
        staging = "(layers, tokens, num_kv_heads, head_dim)"
        _checks.check_rank("stage_k", stage_k, 4, staging)
        _checks.check_rank("stage_v", stage_v, 4, staging)
        _checks.check_dtype("stage_k", stage_k, _checks.FLOAT_DTYPES)
        _checks.check_dtype("stage_v", stage_v, _checks.FLOAT_DTYPES)
        if stage_v.shape != stage_k.shape:
            raise ValueError(
                f"stage_v shape {tuple(stage_v.shape)} must equal stage_k shape "
                f"{tuple(stage_k.shape)}"
            )
        width = block_table.shape[1]
        wanted = (num_layers, width * block_size, num_kv_heads, head_dim)
        if stage_k.shape[0] != num_layers or stage_k.shape[2:] != wanted[2:]:
            raise ValueError(f"stage_k must have shape {wanted}, got {tuple(stage_k.shape)}")
        if stage_k.shape[1] < wanted[1]:
            raise ValueError(
                f"stage_k has {stage_k.shape[1]} rows per layer; a block_table of width {width} "
                f"and blocks of {block_size} need {wanted[1]}"
            )
        for name, tensor in (("stage_k", stage_k), ("stage_v", stage_v)):
            if tensor.dtype != query.dtype:
                raise TypeError(f"{name} must have query's dtype {query.dtype}, got {tensor.dtype}")
        if block_table.shape[0] != 1:
            raise ValueError(
                f"block_table must have one row with history staging (stage_from >= 0), got "
                f"{block_table.shape[0]}"
            )
        if first_block > width:
            raise ValueError(f"stage_from must be in -1..{width}, got {first_block}")
    return layer_index, first_block


def _write_attend_impl(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    action_key: Tensor,
    action_value: Tensor,
    k_pools: Tensor,
    v_pools: Tensor,
    stage_k: Tensor,
    stage_v: Tensor,
    layer: Tensor,
    video_slots: Tensor,
    action_slots: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens_k: Tensor,
    key_gap: Tensor | None,
    stage_from: Tensor,
    stage_key: Tensor,
    stage_tags: Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
) -> Tensor:
    layer_index, first_block = _check_inputs(
        query,
        key,
        value,
        action_key,
        action_value,
        k_pools,
        v_pools,
        stage_k,
        stage_v,
        layer,
        video_slots,
        action_slots,
        block_table,
        cu_seqlens_q,
        seq_lens_k,
        key_gap,
        stage_from,
        stage_key,
        stage_tags,
        max_seqlen_q,
        softmax_scale,
    )
    # 0-dim CPU tensors and the CPU tags: reading them costs no device sync.
    history = int(stage_key)
    kept = history != NOTHING_STAGED and int(stage_tags[layer_index]) == history
    # Until this layer's restage is done, nothing in its staging buffers is vouched for.
    stage_tags[layer_index] = NOTHING_STAGED
    k_cache, v_cache = k_pools[layer_index], v_pools[layer_index]
    k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    write_slots(key, value, k_flat, v_flat, video_slots, check_values=False)
    write_slots(action_key, action_value, k_flat, v_flat, action_slots, check_values=False)
    if first_block < 0:
        return paged_attention(
            query,
            k_cache,
            v_cache,
            block_table,
            cu_seqlens_q,
            seq_lens_k,
            max_seqlen_q=max_seqlen_q,
            softmax_scale=softmax_scale,
            key_gap=key_gap,
            check_values=False,
        )
    layer_k, layer_v = stage_k[layer_index], stage_v[layer_index]
    gather_blocks(
        k_cache,
        v_cache,
        block_table[0],
        layer_k,
        layer_v,
        first_block=first_block if kept else 0,
        check_values=False,
    )
    stage_tags[layer_index] = history
    # The staged window is one contiguous run: attend over it as a single block.
    single_block = torch.zeros(1, 1, dtype=torch.int32, device=query.device)
    return paged_attention(
        query,
        layer_k.unsqueeze(0),
        layer_v.unsqueeze(0),
        single_block,
        cu_seqlens_q,
        seq_lens_k,
        max_seqlen_q=max_seqlen_q,
        softmax_scale=softmax_scale,
        key_gap=key_gap,
        check_values=False,
    )


def _register() -> object:
    """Register the op once per process; later imports reuse the registered one."""
    namespace = getattr(torch.ops, NAMESPACE)
    if hasattr(namespace, OP_NAME):
        return getattr(namespace, OP_NAME).default
    op = torch.library.custom_op(QUALIFIED_NAME, mutates_args=MUTATED_ARGS)(_write_attend_impl)

    @op.register_fake
    def _fake(query: Tensor, *args: object) -> Tensor:
        return torch.empty_like(query)

    return getattr(namespace, OP_NAME).default


write_attend_op = _register()


def write_attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    action_key: Tensor,
    action_value: Tensor,
    k_pools: Tensor,
    v_pools: Tensor,
    stage_k: Tensor,
    stage_v: Tensor,
    inputs: LayerInputs,
) -> Tensor:
    """Write this layer's K/V (video, then action) into the pools and attend; returns ``(q, H, D)``.

    ``k_pools``/``v_pools``: ``(layers, num_blocks, block_size, kv_heads, head_dim)``;
    ``stage_k``/``stage_v``: ``(layers, width * block_size, kv_heads, head_dim)`` (may have zero
    rows when staging is off).
    """
    for name, tensor in (
        ("query", query),
        ("key", key),
        ("value", value),
        ("action_key", action_key),
        ("action_value", action_value),
        ("k_pools", k_pools),
        ("v_pools", v_pools),
        ("stage_k", stage_k),
        ("stage_v", stage_v),
    ):
        _checks.check_tensor(name, tensor)
    # By fields, not class: reloading this module makes a new LayerInputs class.
    if getattr(inputs, "_fields", None) != LayerInputs._fields:
        raise TypeError(f"inputs must be a LayerInputs, got {type(inputs).__name__}")
    # Here, not only in the op: a meta tensor among real ones would dispatch to the fake.
    _checks.check_same_device(
        query=query,
        key=key,
        value=value,
        action_key=action_key,
        action_value=action_value,
        k_pools=k_pools,
        v_pools=v_pools,
        stage_k=stage_k,
        stage_v=stage_v,
    )
    return write_attend_op(
        query, key, value, action_key, action_value, k_pools, v_pools, stage_k, stage_v, *inputs
    )
