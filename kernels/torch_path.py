"""Plain-PyTorch versions of the three kernels, for a CPU without Triton's interpreter.

The launchers dispatch here when their tensors are on the CPU and ``TRITON_INTERPRET`` is not
``1`` (Triton cannot compile for a CPU). Same semantics, float32 accumulation; slow but exact
enough to develop against.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def write_slots(
    key: Tensor, value: Tensor, k_pool: Tensor, v_pool: Tensor, slot_mapping: Tensor
) -> None:
    mapped = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_pool[slots] = key[:mapped][keep].to(k_pool.dtype)
    v_pool[slots] = value[:mapped][keep].to(v_pool.dtype)


def gather_blocks(
    k_cache: Tensor,
    v_cache: Tensor,
    block_ids: Tensor,
    stage_k: Tensor,
    stage_v: Tensor,
    first_block: int,
) -> None:
    block_size = k_cache.shape[1]
    ids = block_ids[first_block:].long()
    rows = slice(first_block * block_size, block_ids.shape[0] * block_size)
    stage_k[rows] = k_cache[ids].flatten(0, 1).to(stage_k.dtype)
    stage_v[rows] = v_cache[ids].flatten(0, 1).to(stage_v.dtype)


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens_k: Tensor,
    *,
    softmax_scale: float | None,
    causal: bool,
    out: Tensor,
    key_limits: Tensor | None,
    key_gap: Tensor | None,
) -> Tensor:
    block_size = k_cache.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    group = q.shape[1] // k_cache.shape[2]
    starts = cu_seqlens_q.tolist()
    for row, k_len in enumerate(seq_lens_k.tolist()):
        lo, hi = starts[row], starts[row + 1]
        if hi == lo:
            continue
        positions = torch.arange(k_len)
        blocks = block_table[row, positions // block_size].long()
        keys = k_cache[blocks, positions % block_size].float().repeat_interleave(group, dim=1)
        values = v_cache[blocks, positions % block_size].float().repeat_interleave(group, dim=1)
        cols = positions[None, :]
        visible = torch.ones(hi - lo, k_len, dtype=torch.bool)
        if causal:
            visible &= cols <= torch.arange(hi - lo)[:, None] + (k_len - (hi - lo))
        if key_limits is not None:
            visible &= cols < key_limits[lo:hi, None].long()
        if key_gap is not None:
            for gap_lo, gap_hi in key_gap[row].reshape(-1, 2).tolist():
                visible &= (cols < gap_lo) | (cols >= gap_hi)
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), keys) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query that sees nothing: zeros
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, values).to(out.dtype)
    return out
