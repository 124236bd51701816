"""The fused write+attend op: one ``torch.library`` custom op per attention layer call.

It writes the current video (and action) K/V into the paged pools with ``write_slots`` and then
attends, either straight over the paged cache or, with history staging, after
``gather_blocks`` restages the window into contiguous buffers. Being one opaque op, a compiled
transformer block stays one graph (``fullgraph=True``).

Why the odd-looking choices:

* The pools of every layer are one stacked tensor and the layer index is a 0-dim CPU tensor,
  so one compiled graph serves every layer: a Python int would be specialised per value.
* The first block to restage is a 0-dim CPU tensor for the same reason (-1: no staging).
* Mutable arguments have no default values: older PyTorch strips trailing defaults before its
  mutation handlers index the arguments.
* Registration is guarded, so re-importing (or reloading) this module does not raise.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kernels.gather_blocks import gather_blocks
from kernels.paged_attention import paged_attention
from kernels.write_slots import write_slots

NAMESPACE = "paged_video"
OP_NAME = "write_attend"
QUALIFIED_NAME = f"{NAMESPACE}::{OP_NAME}"
MUTATED_ARGS = ("k_pools", "v_pools", "stage_k", "stage_v")


class LayerInputs(NamedTuple):
    """Per-forward inputs of the fused op, shared by every layer but ``layer``.

    ``key_gap`` is ``(rows, 2)`` or ``(rows, gaps, 2)`` int32 of hidden key ranges, or None;
    ``stage_from`` is the first block-table entry to restage, or -1 to attend without staging.
    """

    layer: Tensor
    video_slots: Tensor
    action_slots: Tensor
    block_table: Tensor
    cu_seqlens_q: Tensor
    seq_lens_k: Tensor
    key_gap: Tensor | None
    stage_from: Tensor
    max_seqlen_q: int
    softmax_scale: float


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
    max_seqlen_q: int,
    softmax_scale: float,
) -> Tensor:
    # 0-dim CPU tensors: reading them costs no device sync.
    layer_index = int(layer)
    first_block = int(stage_from)
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
    if block_table.shape[0] != 1:
        raise ValueError(f"history staging takes one block-table row, got {block_table.shape[0]}")
    layer_k, layer_v = stage_k[layer_index], stage_v[layer_index]
    gather_blocks(
        k_cache,
        v_cache,
        block_table[0],
        layer_k,
        layer_v,
        first_block=first_block,
        check_values=False,
    )
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
    return write_attend_op(
        query, key, value, action_key, action_value, k_pools, v_pools, stage_k, stage_v, *inputs
    )
