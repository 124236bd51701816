"""Plain-PyTorch versions of the kernels, for a CPU without Triton's interpreter.

The launchers dispatch here when their tensors are on the CPU and ``TRITON_INTERPRET`` is not
``1`` (Triton cannot compile for a CPU). Same semantics, float32 accumulation; slow but exact
enough to develop against.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from paged_video.kernels.quantize import E4M3_MAX, QMAX


def _to_codes(ratio: Tensor, dtype: torch.dtype) -> Tensor:
    """Float32 ``ratio`` (within +-QMAX) as the nearest code of ``dtype``, ties to even: torch's
    own conversion for e4m3 (which rounds right, unlike Triton's interpreter); int8 conversion
    truncates, so it is rounded first."""
    return (torch.round(ratio) if dtype == torch.int8 else ratio).to(dtype)


def quantize_rows(
    x: Tensor, dtype: torch.dtype, qmax: float | None = None
) -> tuple[Tensor, Tensor]:
    """``(codes, scale)`` of float32 rows ``x (..., head_dim)``, as the write kernel computes
    them: ``scale = amax / qmax``, codes ``x / scale`` on the code grid; zero rows all zero.
    ``qmax``: the largest code (default ``QMAX[dtype]``; ``bench accuracy`` emulates the
    deleted e4m3 pool's write, k8v8's target, at ``E4M3_MAX``)."""
    qmax = QMAX[dtype] if qmax is None else qmax
    scale = x.abs().amax(dim=-1) / qmax
    positive = (scale > 0).unsqueeze(-1)
    ratio = x / torch.where(positive, scale.unsqueeze(-1), 1.0)
    ratio = torch.where(positive, ratio, 0.0).clamp(-qmax, qmax)
    return _to_codes(ratio, dtype), scale


def write_slots(
    key: Tensor,
    value: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    k_smooth: Tensor | None = None,
    k_equalizer: Tensor | None = None,
    v_equalizer: Tensor | None = None,
    v_channel_scale: Tensor | None = None,
    v_saturated: Tensor | None = None,
) -> None:
    mapped = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if k_pool.dim() == 4:  # paged pools, in any layout: index (block, offset)
        slots = (slots // k_pool.shape[1], slots % k_pool.shape[1])
    key, value = key[:mapped][keep], value[:mapped][keep]
    if k_scale is None:
        k_pool[slots] = key.to(k_pool.dtype)
        v_pool[slots] = value.to(v_pool.dtype)
        return
    key, value = key.float(), value.float()
    if k_smooth is not None:
        key = key - k_smooth
    if k_equalizer is not None:
        key = key / k_equalizer
    if v_equalizer is not None:
        value = value / v_equalizer
    k_pool[slots], k_scale[slots] = quantize_rows(key, k_pool.dtype)
    if v_scale is None and v_channel_scale is None:  # k8v16: V as it is
        v_pool[slots] = value.to(v_pool.dtype)
        return
    if v_channel_scale is None:
        v_pool[slots], v_scale[slots] = quantize_rows(value, v_pool.dtype)
        return
    # k8v8: V's codes of its (block, KV head, channel) scales, saturating (counted).
    scale = v_channel_scale[slots[0]]
    positive = scale > 0
    ratio = torch.where(positive, value / torch.where(positive, scale, 1.0), 0.0)
    codes = _to_codes(ratio.clamp(-E4M3_MAX, E4M3_MAX), v_pool.dtype)
    if v_saturated is not None:
        over = (ratio.abs() > E4M3_MAX) | (~positive & (value != 0))
        # A row of all-zero codes holding a nonzero value is lost whole (write_slots' rule).
        kept = codes.float().abs().amax(dim=-1, keepdim=True) > 0
        over |= (value != 0) & ~kept
        v_saturated += over.sum().to(v_saturated.dtype)
    v_pool[slots] = codes


def gather_blocks(
    k_cache: Tensor,
    v_cache: Tensor,
    block_ids: Tensor,
    stage_k: Tensor,
    stage_v: Tensor,
    first_block: int,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    stage_k_scale: Tensor | None = None,
    stage_v_scale: Tensor | None = None,
) -> None:
    block_size = k_cache.shape[1]
    ids = block_ids[first_block:].long()
    rows = slice(first_block * block_size, block_ids.shape[0] * block_size)
    stage_k[rows] = k_cache[ids].flatten(0, 1).to(stage_k.dtype)
    stage_v[rows] = v_cache[ids].flatten(0, 1).to(stage_v.dtype)
    if k_scale is not None:
        stage_k_scale[rows] = k_scale[ids].flatten(0, 1)
    if v_scale is not None:  # (k8v8 and k8v16 V have no scale per slot)
        stage_v_scale[rows] = v_scale[ids].flatten(0, 1)


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
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    lse: Tensor | None = None,
    k_equalizer: Tensor | None = None,
    v_equalizer: Tensor | None = None,
    v_channel_scale: Tensor | None = None,
    k8v16: bool = False,
) -> Tensor:
    """Quantized caches as the kernel reads them: the K scale multiplies score columns, the V
    scale probability columns (row sums from unscaled probabilities). ``k_equalizer`` multiplies q's
    channels first, ``v_equalizer`` the output's last. ``lse`` (float32 ``(total_q, H)``)
    receives each row's log-sum-exp of its visible scores, -inf for a row that sees none.
    ``v_channel_scale`` (k8v8): int8 query rows, the probabilities (a row's largest 448) rounded
    to e4m3 after the final row max (the whole sequence one key tile), V's codes times their
    block's channel scales. ``k8v16``: int8 query rows, V as stored.
    """
    k8v8 = v_channel_scale is not None
    block_size = k_cache.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    group = q.shape[1] // k_cache.shape[2]
    queries = q.float()
    if k_equalizer is not None:
        queries = queries * k_equalizer.repeat_interleave(group, dim=0)
    if k8v8 or k8v16:
        codes, row_scale = quantize_rows(queries, torch.int8)
        queries = (codes.float(), row_scale)
    else:
        queries = (queries, None)
    starts = cu_seqlens_q.tolist()
    for row, k_len in enumerate(seq_lens_k.tolist()):
        lo, hi = starts[row], starts[row + 1]
        if hi == lo:
            continue
        if k_len == 0:
            # No keys: zeros and -inf, as for rows whose keys are all hidden (a max over no
            # keys would raise).
            out[lo:hi] = 0
            if lse is not None:
                lse[lo:hi] = float("-inf")
            continue
        positions = torch.arange(k_len)
        blocks = block_table[row, positions // block_size].long()
        slots = positions % block_size
        keys = k_cache[blocks, slots].float().repeat_interleave(group, dim=1)
        values = v_cache[blocks, slots].float()
        if k8v8:
            values = values * v_channel_scale[blocks]
        values = values.repeat_interleave(group, dim=1)
        cols = positions[None, :]
        visible = torch.ones(hi - lo, k_len, dtype=torch.bool)
        if causal:
            visible &= cols <= torch.arange(hi - lo)[:, None] + (k_len - (hi - lo))
        if key_limits is not None:
            visible &= cols < key_limits[lo:hi, None].long()
        if key_gap is not None:
            for gap_lo, gap_hi in key_gap[row].reshape(-1, 2).tolist():
                visible &= ((positions < gap_lo) | (positions >= gap_hi))[None, :]
        scores = torch.einsum("qhd,khd->hqk", queries[0][lo:hi], keys) * scale
        if k8v8 or k8v16:
            scores = scores * queries[1][lo:hi].T[:, :, None]
        if k_scale is not None:
            scores = scores * k_scale[blocks, slots].repeat_interleave(group, dim=1).T[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        row_max = scores.amax(dim=-1, keepdim=True)
        safe_max = torch.where(row_max == float("-inf"), 0.0, row_max)
        probs = torch.exp(scores - safe_max)
        row_sum = probs.sum(dim=-1, keepdim=True)
        if lse is not None:
            # (H, q, 1) -> (q, H); log(0) is the -inf of a row that sees nothing.
            lse[lo:hi] = (safe_max + torch.log(row_sum)).squeeze(-1).T
        if k8v8:
            probs = _to_codes(probs * 448.0, torch.float8_e4m3fn).float() / 448.0
        if v_scale is not None:
            probs = probs * v_scale[blocks, slots].repeat_interleave(group, dim=1).T[:, None]
        out_rows = torch.einsum("hqk,khd->qhd", probs, values)
        if v_equalizer is not None:
            out_rows = out_rows * v_equalizer.repeat_interleave(group, dim=0)
        # A query that sees nothing: zeros.
        out[lo:hi] = (out_rows / torch.where(row_sum == 0, 1.0, row_sum).permute(1, 0, 2)).to(
            out.dtype
        )
    return out


def merge_attention_states(
    outs: list[Tensor], lses: list[Tensor], *, out: Tensor, out_lse: Tensor
) -> None:
    """Partial attentions merged by their LSEs into ``out``/``out_lse``, float32 math: weights
    ``exp(lse_i - max lse)``; a part with LSE -inf weighs 0 (its output is not used), and a row
    no part saw gets zeros and -inf."""
    if not outs:
        out.zero_()
        out_lse.fill_(-math.inf)
        return
    lse = torch.stack(lses)
    row_max = lse.amax(dim=0)
    row_max = torch.where(row_max == -math.inf, 0.0, row_max)
    weights = torch.exp(lse - row_max)
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for part, part_lse, weight in zip(outs, lses, weights, strict=True):
        seen = (part_lse > -math.inf).unsqueeze(-1)
        acc += torch.where(seen, part.float() * weight.unsqueeze(-1), 0.0)
    weight_sum = weights.sum(dim=0)
    seen_any = weight_sum > 0
    weight_sum = torch.where(seen_any, weight_sum, 1.0)
    out.copy_(acc / weight_sum.unsqueeze(-1))
    out_lse.copy_(torch.where(seen_any, row_max + torch.log(weight_sum), -math.inf))
