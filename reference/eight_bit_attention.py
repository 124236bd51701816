"""Float64 emulation of attention with both products on 8-bit tensor cores (issue 45's format).

Every step the kernel rounds is rounded here exactly as the kernel rounds it; everything else is
float64, so a CPU test tells the format's error from the kernel's. The steps:

1. **Queries** (:func:`quantize_queries`): per block of ``q_rows_per_scale`` rows of a query
   head, ``scale = amax / qmax`` and codes ``q / scale``, in K's code dtype (the MMA takes two
   operands of one kind: int8 with int8 K, e4m3 with e4m3 K). As ``kernels.write_slots``
   rounds: float32 amax, float32 quotients (correctly rounded), rounded to the nearest code,
   ties to even. K's equalization factors are folded into q first (powers of two: exact).
2. **Keys** (:func:`quantize_keys`): minus the smoothing mean, divided by the equalization
   factors (float32, as ``write_slots``), then one scale per ``k_keys_per_scale`` consecutive
   keys and KV head (1: per slot, today's storage).
3. **Values** (:func:`quantize_values`): e4m3 codes with one scale per channel, either frozen
   per (KV head, channel) from the first ``first_write`` keys (``amax * v_headroom / 448``;
   later values beyond it saturate) and applied in the epilogue, or per (block of
   ``v_keys_per_scale`` keys, KV head, channel), applied when the MMA accumulator is flushed.
   For comparison: ``"slot"`` (today's e4m3 row scale, multiplied into each probability) and
   ``"none"`` (V as given: a 16-bit V pool).
4. **Scores**: int8 ``Q K^T`` are exact integer sums; e4m3 products are exact and summed in
   the MMA accumulator (step 6's model, per 32 channels). Then times the Q and K scales and
   the softmax scale, in float64.
5. **Probabilities**: exact softmax with the final row max (the kernel's online max rounds
   other single values, at the same sizes): ``P = exp(s - rowmax) * p_scale`` rounded to
   ``p_dtype`` through float32, as the kernel converts (e4m3 at 448: the kernel's exp2 biased by
   log2(448), free; ``p_dtype=None``: P in float64). The normalizer sums the unrounded P
   (``"unrounded"``: the float32 values the kernel has anyway) or the rounded ones
   (``"rounded"``: k8v8's kernel takes them from the ``P V`` MMA, over a column of ones beside
   V, so they go through step 6's accumulator as a channel of V would, with no instruction per
   probability; summed in the loop they would cost a conversion back each).
6. **P V with a two-level accumulator**: the MMA adds 32 keys (one k-step) at a time into an
   accumulator that keeps ``acc_bits`` mantissa bits after the leading one, truncated toward
   zero after each k-step (Hopper's FP8 MMA accumulates in "fp32" that keeps 13: FP22 = 1 sign,
   8 exponent, 13 mantissa bits, as SageAttention2 measured); every ``flush_tiles`` tiles of
   ``tile_keys`` keys it is added into a true float buffer (exact here) and restarts at zero.
   ``acc_bits=None``: exact.
7. **Epilogue**: buffer times the frozen V scales (or the probability unit), over the
   normalizer.

Keys are in sequence order; tiles, K tiles and V blocks are consecutive runs from the first key
(a paged pool's are the same where its block size is a multiple of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import Tensor

from paged_video.reference.quantize import QMAX

E4M3 = torch.float8_e4m3fn
V_SCALES = ("frozen", "block", "slot", "none")
NORMALIZERS = ("unrounded", "rounded")
# One MMA k-step: 32 8-bit elements along the reduction axis (wgmma k for e4m3 and int8).
MMA_K = 32
# What P is multiplied by before its rounding, per dtype: e4m3's largest value; 1 for 16 bits.
P_SCALE = {E4M3: 448.0, torch.float16: 1.0, torch.bfloat16: 1.0}
# Hopper's FP8 MMA accumulator: 13 mantissa bits after the leading one (FP22).
FP8_MMA_ACC_BITS = 13


@dataclass(frozen=True)
class EightBitFormat:
    """The format and the kernel's arithmetic (module docstring, steps 1-7).

    ``k_dtype``: int8 or e4m3 (K's codes, and Q's). ``p_dtype``: e4m3, float16, bfloat16 or
    None (exact P). ``acc_bits``: the MMA accumulator's mantissa bits (None: exact)."""

    k_dtype: torch.dtype = torch.int8
    k_keys_per_scale: int = 1
    q_rows_per_scale: int = 64
    v_scales: str = "frozen"
    v_headroom: float = 16.0
    v_keys_per_scale: int = 64
    p_dtype: torch.dtype | None = E4M3
    normalizer: str = "unrounded"
    acc_bits: int | None = FP8_MMA_ACC_BITS
    flush_tiles: int = 1
    tile_keys: int = 64

    def __post_init__(self) -> None:
        if self.k_dtype not in QMAX:
            raise TypeError(f"k_dtype must be one of {list(QMAX)}, got {self.k_dtype}")
        if self.p_dtype is not None and self.p_dtype not in P_SCALE:
            raise TypeError(f"p_dtype must be one of {list(P_SCALE)} or None, got {self.p_dtype}")
        if self.v_scales not in V_SCALES:
            raise ValueError(f"v_scales must be one of {V_SCALES}, got {self.v_scales!r}")
        if self.normalizer not in NORMALIZERS:
            raise ValueError(f"normalizer must be one of {NORMALIZERS}, got {self.normalizer!r}")
        for name in ("k_keys_per_scale", "q_rows_per_scale", "v_keys_per_scale", "flush_tiles"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tile_keys < 1 or self.tile_keys % MMA_K:
            raise ValueError(f"tile_keys must be a multiple of {MMA_K}, got {self.tile_keys}")
        if not self.v_headroom >= 1:
            raise ValueError(f"v_headroom must be >= 1, got {self.v_headroom}")
        if self.acc_bits is not None and not 1 <= self.acc_bits <= 52:
            raise ValueError(f"acc_bits must be in [1, 52] or None, got {self.acc_bits}")
        if self.v_scales == "block" and self.v_keys_per_scale % self.flush_keys:
            raise ValueError(
                f"v_keys_per_scale ({self.v_keys_per_scale}) must be a multiple of the keys per "
                f"flush (flush_tiles * tile_keys = {self.flush_keys}): a block's scale is "
                "applied at a flush"
            )
        if self.v_scales != "none" and self.p_dtype is not None and self.p_dtype != E4M3:
            raise ValueError("an e4m3 V takes p_dtype e4m3 or None (the MMA's operands)")
        if self.v_scales == "slot" and self.normalizer == "rounded":
            raise ValueError("v_scales 'slot' rounds P times the V scales: no rounded normalizer")

    @property
    def flush_keys(self) -> int:
        return self.flush_tiles * self.tile_keys


# The formats docs/quantization.md chose ("Choosing the 8-bit format"): the fast one (int8 Q per
# row, int8 K per slot smoothed and equalized as today, e4m3 V per 64 keys and channel, e4m3 P
# summed by the P V MMA, flushed every 64-key tile) and the accurate one (the same Q and K; V and
# P in bf16, an exact float32 accumulator).
FAST_FORMAT = EightBitFormat(
    q_rows_per_scale=1, v_scales="block", v_keys_per_scale=64, normalizer="rounded"
)
ACCURATE_FORMAT = EightBitFormat(
    q_rows_per_scale=1, v_scales="none", p_dtype=torch.bfloat16, acc_bits=None
)
# k8v8 as it ships (``PagingConfig(kv_format="k8v8")``): the fast format with V's channel scales
# frozen at the layer's first write, headroom 256 (``kernels.value_channels.V_HEADROOM``), each
# FP8 ``P V`` sum added into float32 once a key tile of the launch (128 keys at frame-sized
# blocks). The kernel's oracles (``bench.sweep``, ``bench.accuracy``) and ``bench.eight_bit_choice``
# take it, replacing what their run sets (the accumulator, the tile).
K8V8_FORMAT = replace(FAST_FORMAT, v_scales="frozen", v_headroom=256.0, tile_keys=128)


class Codes(NamedTuple):
    """Codes and their float32 scales (shapes per function)."""

    codes: Tensor
    scale: Tensor


def round_codes(ratio: Tensor, dtype: torch.dtype) -> Tensor:
    """Float32 ``ratio`` clamped to +-qmax and rounded to the nearest code of ``dtype``, ties to
    even (int8: ``torch.round``; e4m3: torch's float32 conversion)."""
    qmax = QMAX[dtype]
    clamped = ratio.to(torch.float32).clamp(-qmax, qmax)
    return torch.round(clamped).to(dtype) if dtype == torch.int8 else clamped.to(dtype)


def _codes_by_group(
    x32: Tensor, amax: Tensor, dtype: torch.dtype, expand: int, rounded: bool = True
) -> Codes:
    """Codes of float32 ``x32 (L, H, D)`` under ``scale = amax / qmax`` (float32, per group of
    ``expand`` consecutive rows and head: ``amax (groups, H)``); ``rounded=False``: the float32
    quotients as they are (float64), the codes a format without this rounding would hold."""
    scale = amax / QMAX[dtype]  # float32 division, correctly rounded as div_rn
    divisor = scale.repeat_interleave(expand, dim=0)[: x32.shape[0]].unsqueeze(-1)
    ratio = torch.where(divisor > 0, x32 / torch.where(divisor > 0, divisor, 1.0), 0.0)
    return Codes(round_codes(ratio, dtype) if rounded else ratio.to(torch.float64), scale)


def _group_amax(x32: Tensor, rows: int) -> Tensor:
    """``(ceil(L / rows), H)`` amax of ``|x32 (L, H, D)|`` over runs of ``rows`` rows and D."""
    return _pad_keys(x32.abs(), 0, rows).unflatten(0, (-1, rows)).amax(dim=(1, 3))


def quantize_queries(
    q: Tensor, fmt: EightBitFormat, k_factor: Tensor | None = None, *, rounded: bool = True
) -> Codes:
    """``q (Lq, H, D)`` as codes of ``fmt.k_dtype`` and scales ``(ceil(Lq / R), H)``, one per
    block of ``R = fmt.q_rows_per_scale`` rows and head. ``k_factor (Hkv, D)``: K's
    equalization factors, multiplied into q first (float32). ``rounded=False``: the codes
    unrounded (float64), to tell the queries' rounding from the rest of the format's error."""
    q32 = q.to(torch.float32)
    if k_factor is not None:
        group = q.shape[1] // k_factor.shape[0]
        q32 = q32 * k_factor.to(torch.float32).repeat_interleave(group, dim=0)
    rows = fmt.q_rows_per_scale
    return _codes_by_group(q32, _group_amax(q32, rows), fmt.k_dtype, rows, rounded)


def quantize_keys(
    k: Tensor,
    fmt: EightBitFormat,
    *,
    smooth: Tensor | None = None,
    factor: Tensor | None = None,
    rounded: bool = True,
) -> Codes:
    """``k (Lk, Hkv, D)`` minus ``smooth``, divided by ``factor`` (both ``(Hkv, D)``; float32,
    as ``write_slots``) as codes of ``fmt.k_dtype`` and scales ``(ceil(Lk / G), Hkv)``, one per
    ``G = fmt.k_keys_per_scale`` consecutive keys and KV head. ``rounded=False``: the codes
    unrounded (float64), as :func:`quantize_queries`'."""
    k32 = k.to(torch.float32)
    if smooth is not None:
        k32 = k32 - smooth.to(torch.float32)
    if factor is not None:
        k32 = k32 / factor.to(torch.float32)
    keys = fmt.k_keys_per_scale
    return _codes_by_group(k32, _group_amax(k32, keys), fmt.k_dtype, keys, rounded)


def quantize_values(v: Tensor, fmt: EightBitFormat, first_write: int | None = None) -> Codes:
    """``v (Lk, Hkv, D)`` as e4m3 codes under ``fmt.v_scales``:

    - ``"frozen"``: scales ``(Hkv, D)``, ``amax * v_headroom / 448`` over the first
      ``first_write`` keys (float32; a channel zero there takes its head's largest channel's
      scale, a head zero there 1), saturating beyond;
    - ``"block"``: scales ``(ceil(Lk / G), Hkv, D)``, per ``G = fmt.v_keys_per_scale`` keys;
    - ``"slot"``: scales ``(Lk, Hkv)``, today's row scale;
    - ``"none"``: V as given, in float64, with scales ``(Hkv, D)`` of ones.
    """
    v32 = v.to(torch.float32)
    length, heads, dim = v32.shape
    if fmt.v_scales == "none":
        return Codes(v.to(torch.float64), v32.new_ones(heads, dim))
    if fmt.v_scales == "slot":
        return _codes_by_group(v32, v32.abs().amax(dim=-1), E4M3, 1)
    if fmt.v_scales == "block":
        keys = fmt.v_keys_per_scale
        padded = _pad_keys(v32.abs(), 0, keys)
        scale = padded.unflatten(0, (-1, keys)).amax(dim=1) / QMAX[E4M3]
        per_key = scale.repeat_interleave(keys, dim=0)[:length]
    else:
        if first_write is None or not 1 <= first_write <= length:
            raise ValueError(f"first_write must be in [1, {length}] for frozen scales")
        amax = v32[:first_write].abs().amax(dim=0)
        scale = amax * fmt.v_headroom / QMAX[E4M3]
        head_max = scale.amax(dim=-1, keepdim=True)
        scale = torch.where(scale > 0, scale, torch.where(head_max > 0, head_max, 1.0))
        per_key = scale.expand(length, heads, dim)
    ratio = torch.where(per_key > 0, v32 / torch.where(per_key > 0, per_key, 1.0), 0.0)
    return Codes(round_codes(ratio, E4M3), scale)


def truncate_mantissa(x: Tensor, bits: int | None) -> Tensor:
    """Float64 ``x`` with ``bits`` mantissa bits after the leading one, truncated toward zero
    (None: ``x``)."""
    if bits is None:
        return x
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2**exponent, 0.5 <= |mantissa| < 1
    return torch.ldexp(torch.trunc(mantissa * 2.0 ** (bits + 1)), exponent - (bits + 1))


def _accumulate(partials: Tensor, bits: int | None, steps_per_flush: int) -> Tensor:
    """Sum ``partials (..., S, D)`` (exact sums of one k-step each) along S with the two-level
    accumulator: truncated to ``bits`` after each step, flushed (exactly) every
    ``steps_per_flush`` steps. Returns the flushed sums ``(..., ceil(S / steps), D)``."""
    # Every flush at once, a step of each at a time: ``steps_per_flush`` operations, not one
    # per k-step (the shipped window's 878 were ~1,300 kernel launches per call on a GPU). The
    # zero steps that pad the last flush change nothing: ``x + 0`` is exact and truncation
    # keeps what it kept.
    flushes = _pad_keys(partials, -2, steps_per_flush).unflatten(-2, (-1, steps_per_flush))
    acc = torch.zeros_like(flushes[..., 0, :])
    for step in range(steps_per_flush):
        acc = truncate_mantissa(acc + flushes[..., step, :], bits)
    return acc


def _pad_keys(x: Tensor, dim: int, multiple: int) -> Tensor:
    """``x`` zero-padded along ``dim`` to a multiple of ``multiple``."""
    extra = -x.shape[dim] % multiple
    if not extra:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def attend_codes(
    queries: Codes,
    keys: Codes,
    values: Codes,
    fmt: EightBitFormat,
    *,
    softmax_scale: float | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Float64 ``(Lq, H, D)`` attention over codes made by :func:`quantize_queries`,
    :func:`quantize_keys` and :func:`quantize_values` with ``fmt`` (steps 4-7 of the module
    docstring). ``mask (Lq, Lk)``: True where a query may attend (a row with none gives 0).
    """
    q_codes, k_codes, v_codes = queries.codes, keys.codes, values.codes
    num_q, heads, dim = q_codes.shape
    num_k, kv_heads, _ = k_codes.shape
    group = heads // kv_heads
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(dim)

    def per_head(x: Tensor) -> Tensor:  # (L, Hkv, ...) -> (H, L, ...)
        return x.repeat_interleave(group, dim=1).transpose(0, 1)

    # Step 4: scores. (H, Lq, Lk)
    q64 = q_codes.to(torch.float64).transpose(0, 1)
    k64 = per_head(k_codes.to(torch.float64))
    if fmt.k_dtype == torch.int8:
        dots = q64 @ k64.transpose(1, 2)  # integer sums below 2**53: exact
    else:
        q_steps = _pad_keys(q64, -1, MMA_K).unflatten(-1, (-1, MMA_K))  # (H, Lq, S, 32)
        k_steps = _pad_keys(k64, -1, MMA_K).unflatten(-1, (-1, MMA_K))  # (H, Lk, S, 32)
        partials = torch.einsum("hqsc,hksc->hqsk", q_steps, k_steps)  # (H, Lq, S, Lk)
        dots = _accumulate(partials, fmt.acc_bits, partials.shape[-2]).squeeze(-2)
    q_scale = queries.scale.to(torch.float64).repeat_interleave(fmt.q_rows_per_scale, dim=0)
    k_scale = keys.scale.to(torch.float64).repeat_interleave(fmt.k_keys_per_scale, dim=0)
    scores = dots * (q_scale[:num_q].T[:, :, None] * per_head(k_scale[:num_k])[:, None, :])
    scores = scores * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.to(torch.bool), float("-inf"))

    # Step 5: probabilities.
    row_max = scores.amax(dim=-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
    probs = torch.exp(scores - row_max)
    unit = q64.new_ones(heads, 1, dim)
    if fmt.v_scales == "slot":
        # Today's FP8-MMA: P times each key's V scale, in a unit of the largest / 448.
        v_rows = per_head(values.scale.to(torch.float64))[:, None, :]  # (H, 1, Lk)
        largest = v_rows.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        weights = probs * (v_rows / largest) * QMAX[E4M3]
        unit = unit * (largest / QMAX[E4M3])
    else:
        p_scale = 1.0 if fmt.p_dtype is None else P_SCALE[fmt.p_dtype]
        weights = probs * p_scale
        unit = unit / p_scale
    if fmt.p_dtype is not None:
        weights = weights.to(torch.float32).to(fmt.p_dtype).to(torch.float64)
    # Step 6: P V, one exact sum per k-step of 32 keys, into the two-level accumulator.
    v64 = per_head(v_codes.to(torch.float64))  # (H, Lk, D)
    w_steps = _pad_keys(weights, -1, fmt.tile_keys).unflatten(-1, (-1, MMA_K))  # (H, Lq, S, 32)
    v_steps = _pad_keys(v64, 1, fmt.tile_keys).unflatten(1, (-1, MMA_K))  # (H, S, 32, D)
    partials = torch.einsum("hqsk,hskd->hqsd", w_steps, v_steps)
    steps_per_flush = fmt.flush_keys // MMA_K
    flushed = _accumulate(partials, fmt.acc_bits, steps_per_flush)  # (H, Lq, F, D)
    if fmt.normalizer == "unrounded":
        row_sum = probs.sum(dim=-1, keepdim=True)
    else:
        # The rounded P summed as a column of ones beside V: the same k-steps and flushes.
        sums = _accumulate(w_steps.sum(dim=-1, keepdim=True), fmt.acc_bits, steps_per_flush)
        row_sum = sums.sum(dim=-2) * unit[..., :1]
    if fmt.v_scales == "block":
        # Each flush lies in one V block: times that block's scales, (H, F, D).
        blocks = per_head(values.scale.to(torch.float64))
        per_flush = blocks.repeat_interleave(fmt.v_keys_per_scale // fmt.flush_keys, dim=1)
        buffer = (flushed * per_flush[:, None, : flushed.shape[-2]]).sum(dim=-2)
    else:
        buffer = flushed.sum(dim=-2)

    # Step 7: epilogue.
    if fmt.v_scales in ("frozen", "none"):
        unit = unit * values.scale.to(torch.float64).repeat_interleave(group, dim=0)[:, None, :]
    out = buffer * unit / torch.where(row_sum > 0, row_sum, 1.0)
    return out.transpose(0, 1).contiguous()


def attend_codes_by_rows(
    queries: Codes, keys: Codes, values: Codes, fmt: EightBitFormat, rows_per_call: int
) -> Tensor:
    """:func:`attend_codes` (no mask, the default softmax scale) ``rows_per_call`` query rows at
    a time, a multiple of ``fmt.q_rows_per_scale``: each row's output as one call gives it, the
    score matrices bounded."""
    per_scale = fmt.q_rows_per_scale
    if rows_per_call < 1 or rows_per_call % per_scale:
        raise ValueError(
            f"rows_per_call must be a positive multiple of q_rows_per_scale ({per_scale}), "
            f"got {rows_per_call}"
        )
    codes = queries.codes
    out = torch.empty(codes.shape, dtype=torch.float64, device=codes.device)
    for start in range(0, codes.shape[0], rows_per_call):
        rows = slice(start, start + rows_per_call)
        scales = slice(start // per_scale, (start + rows_per_call) // per_scale)
        out[rows] = attend_codes(Codes(codes[rows], queries.scale[scales]), keys, values, fmt)
    return out


def eight_bit_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    fmt: EightBitFormat,
    *,
    first_write: int | None = None,
    smooth: Tensor | None = None,
    k_factor: Tensor | None = None,
    softmax_scale: float | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Float64 ``(Lq, H, D)``: ``q (Lq, H, D)`` attending over ``k``/``v (Lk, Hkv, D)``
    quantized and attended as ``fmt`` says. ``first_write``: the keys whose V sets frozen
    scales; ``smooth``/``k_factor (Hkv, D)``: K's smoothing mean and equalization factors."""
    return attend_codes(
        quantize_queries(q, fmt, k_factor),
        quantize_keys(k, fmt, smooth=smooth, factor=k_factor),
        quantize_values(v, fmt, first_write),
        fmt,
        softmax_scale=softmax_scale,
        mask=mask,
    )
