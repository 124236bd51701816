"""Float64 oracles of attention over quantized K/V, as each attention mode computes it.

Stored rows read back as ``codes * scale`` (``reference.quantize``). Channel equalization
factors fold into q (K's factors) and into the output (V's), so in exact arithmetic the result
is attention over ``codes * scale * factor``. The modes:

* ``dequant``: exact arithmetic on those values (the kernel converts codes exactly and applies
  the scales in float32): plain float64 attention.
* ``fp8-mma``: each (query, head) row of q, times K's factors, is rounded to e4m3 codes with its
  own scale (``amax / 448``); the probabilities times the V scales, in units of the sequence's
  largest V scale / 448 (over the keys outside its gaps, as the kernel's unit), are rounded to
  e4m3 (the kernel's probabilities are after its running row max; here after the final one,
  so single roundings differ but not their size).
* ``int8-mma``: each q row, times K's factors, is rounded to int8 codes (``amax / 127``);
  ``Q K^T`` of two int8 code tiles is then exact (int32 accumulation); ``P V`` as ``dequant``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from paged_video.reference.attention import attention_mask, dense_attention, gather_sequence
from paged_video.reference.quantize import dequantize, round_rows

MODES = ("dequant", "fp8-mma", "int8-mma")
_QUERY_DTYPE = {"fp8-mma": torch.float8_e4m3fn, "int8-mma": torch.int8}
E4M3_MAX = 448.0
FLOAT32_TINY = torch.finfo(torch.float32).tiny


def quantized_attention(
    q: Tensor,
    k_codes: Tensor,
    k_scale: Tensor,
    v_codes: Tensor,
    v_scale: Tensor,
    *,
    mode: str = "dequant",
    k_factor: Tensor | None = None,
    v_factor: Tensor | None = None,
    softmax_scale: float | None = None,
    mask: Tensor | None = None,
    unit_keys: Tensor | None = None,
) -> Tensor:
    """Float64 ``(Lq, H, D)`` attention of ``q (Lq, H, D)`` over one sequence's codes
    ``(Lk, Hkv, D)`` and scales ``(Lk, Hkv)`` in attention mode ``mode``.

    ``k_factor``/``v_factor`` ``(Hkv, D)``: the equalization factors the rows were divided by
    before quantizing. ``mask`` ``(Lq, Lk)``: True where a query may attend (a query that may
    attend nothing gets zeros). ``unit_keys`` ``(Lk,)``: the keys whose V scales set the
    ``fp8-mma`` unit (default all: the paged form leaves out the gaps').
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    group = q.shape[1] // k_codes.shape[1]
    q64 = q.to(torch.float64)
    if k_factor is not None:
        q64 = q64 * k_factor.to(torch.float64).repeat_interleave(group, dim=0)
    if mode in _QUERY_DTYPE:
        q64 = round_rows(q64, _QUERY_DTYPE[mode])
    keys = dequantize(k_codes, k_scale)
    if mode == "fp8-mma":
        out = _fp8_probabilities_attention(
            q64, keys, v_codes, v_scale, softmax_scale, mask, unit_keys
        )
    else:
        values = dequantize(v_codes, v_scale)
        out = dense_attention(q64, keys, values, softmax_scale=softmax_scale, mask=mask)
    if v_factor is not None:
        out = out * v_factor.to(torch.float64).repeat_interleave(group, dim=0)
    return out


def _fp8_probabilities_attention(
    q64: Tensor,
    keys: Tensor,
    v_codes: Tensor,
    v_scale: Tensor,
    softmax_scale: float | None,
    mask: Tensor | None,
    unit_keys: Tensor | None,
) -> Tensor:
    """Attention whose V-scaled probabilities are rounded to e4m3 before ``P V``."""
    _, num_heads, head_dim = q64.shape
    group = num_heads // keys.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # (H, Lk, D)
    codes = v_codes.to(torch.float64).repeat_interleave(group, dim=1).transpose(0, 1)
    v_cols = v_scale.to(torch.float64).repeat_interleave(group, dim=1).T[:, None, :]  # (H,1,Lk)
    scores = q64.transpose(0, 1) @ keys.transpose(1, 2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
    probs = torch.exp(scores - row_max)
    unit_cols = v_cols if unit_keys is None else v_cols.masked_fill(~unit_keys.cpu(), 0.0)
    # At least float32's smallest normal, as the kernel's.
    largest = unit_cols.amax(dim=-1, keepdim=True).clamp_min(E4M3_MAX * FLOAT32_TINY)
    unit = largest / E4M3_MAX
    ratio = (probs * (v_cols / unit)).clamp(-E4M3_MAX, E4M3_MAX)
    rounded = ratio.to(torch.float8_e4m3fn).to(torch.float64) * unit
    row_sum = probs.sum(dim=-1, keepdim=True)
    out = (rounded @ codes) / torch.where(row_sum > 0, row_sum, 1.0)
    return out.transpose(0, 1).contiguous()


def paged_quantized_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens_k: Tensor,
    *,
    k_scale: Tensor,
    v_scale: Tensor,
    mode: str = "dequant",
    k_factor: Tensor | None = None,
    v_factor: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    key_limits: Tensor | None = None,
    key_gap: Tensor | None = None,
) -> Tensor:
    """:func:`quantized_attention` with ``kernels.paged_attention``'s arguments (code caches
    ``(num_blocks, block_size, Hkv, D)``, scales without ``D``); float64 ``(total_q, H, D)`` on
    the CPU."""
    q = q.cpu()
    out = torch.zeros(q.shape, dtype=torch.float64)
    starts = cu_seqlens_q.tolist()
    for i, k_len in enumerate(seq_lens_k.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        row = block_table[i].cpu()
        k_codes, k_scales, v_codes, v_scales = (
            gather_sequence(t.cpu(), row, k_len) for t in (k_cache, k_scale, v_cache, v_scale)
        )
        gaps = None if key_gap is None else key_gap[i].reshape(-1, 2).tolist()
        mask = attention_mask(
            hi - lo,
            k_len,
            causal=causal,
            key_limits=None if key_limits is None else key_limits[lo:hi].cpu(),
            key_gap=gaps,
        )
        positions = torch.arange(k_len)
        outside_gaps = torch.ones(k_len, dtype=torch.bool)
        for gap_lo, gap_hi in gaps or []:
            outside_gaps &= (positions < gap_lo) | (positions >= gap_hi)
        out[lo:hi] = quantized_attention(
            q[lo:hi],
            k_codes,
            k_scales,
            v_codes,
            v_scales,
            mode=mode,
            k_factor=None if k_factor is None else k_factor.cpu(),
            v_factor=None if v_factor is None else v_factor.cpu(),
            softmax_scale=softmax_scale,
            mask=mask,
            unit_keys=outside_gaps,
        )
    return out
