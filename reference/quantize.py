"""Float64 oracle of quantized KV storage: what a quantized pool row should hold and reads back as.

Per row of ``head_dim`` values: ``scale = amax(|x|) / qmax`` (rounded to float32, as stored),
codes = ``x / scale`` rounded to the nearest code (ties to even), saturating at ``qmax``. A zero
row has scale 0 and codes 0. ``smooth`` (K smoothing) is subtracted first; attention is
unchanged by it, since every query sees the same shift ``q . smooth`` on all its scores.
``factor`` (channel equalization) then divides each channel; attention multiplies q (for K) or
the output (for V) by it again, so it changes nothing in exact arithmetic.

:func:`channel_factors` is the oracle of how the factors are chosen; :func:`quantize_best_scale`
quantizes with the per-row scale that minimises the squared error, the best any per-row scale
can do (the format's floor).
"""

from __future__ import annotations

import torch
from torch import Tensor

QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


# Channel equalization: factors are powers of two (folding them into q and the output is then
# exact in every float format), at least 1 (only channels wider than the head's median channel
# shrink) and at most 2**MAX_FACTOR_LOG2 (q times a factor stays finite in float16).
MAX_FACTOR_LOG2 = 8
# The share of a channel's excess width (log2) taken out of K (the rest goes to q) and of V.
K_SHARE = 0.5
V_SHARE = 1.0
# quantize_best_scale tries scales amax / qmax * t for this many t evenly spaced in [0.5, 1].
BEST_SCALE_STEPS = 65


def quantize(
    x: Tensor,
    dtype: torch.dtype,
    *,
    smooth: Tensor | None = None,
    factor: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(codes, scale)`` of ``x (..., head_dim)``: codes in ``dtype``, a float32 scale per row.

    ``smooth`` is subtracted from every row first, then each channel is divided by ``factor``
    (both ``(..., head_dim)``, broadcast over the rows).
    """
    qmax = _qmax(dtype)
    x64 = _prepare(x, smooth, factor)
    scale = (x64.abs().amax(dim=-1) / qmax).to(torch.float32)
    return _codes(x64, scale, dtype), scale


def quantize_best_scale(
    x: Tensor,
    dtype: torch.dtype,
    *,
    smooth: Tensor | None = None,
    factor: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`quantize` with, per row, the scale of least squared error among
    ``amax / qmax * t``, ``t`` in ``[0.5, 1]`` (smaller scales clip the row's largest values to
    refine the rest; e4m3's relative grid repeats every octave, so one octave covers it)."""
    qmax = _qmax(dtype)
    x64 = _prepare(x, smooth, factor)
    amax_scale = x64.abs().amax(dim=-1) / qmax
    best_error = torch.full_like(amax_scale, float("inf"))
    best_scale = amax_scale.to(torch.float32)
    for t in torch.linspace(0.5, 1.0, BEST_SCALE_STEPS).tolist():
        scale = (amax_scale * t).to(torch.float32)
        error = (dequantize(_codes(x64, scale, dtype), scale) - x64).square().sum(dim=-1)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_scale = torch.where(better, scale, best_scale)
    return _codes(x64, best_scale, dtype), best_scale


def channel_factors(x: Tensor, *, smooth: Tensor | None = None, share: float = V_SHARE) -> Tensor:
    """Equalization factors ``(heads, head_dim)`` chosen from the rows ``x (tokens, heads,
    head_dim)`` of a first write (minus ``smooth``): per (head, channel), the root mean square
    over the finite rows divided by the head's median channel's (the lower middle one); its
    log2 times ``share`` (``K_SHARE`` for keys), rounded to an integer and clamped to
    ``[0, MAX_FACTOR_LOG2]``, is the factor's exponent. A head whose median is 0 or not finite,
    and a channel with no finite row, get factor 1."""
    x64 = x.to(torch.float64)
    if smooth is not None:
        x64 = x64 - smooth.to(torch.float64)
    finite = x64.isfinite()
    squares = torch.where(finite, x64, 0.0).square().sum(dim=0)
    rms = (squares / finite.sum(dim=0).clamp_min(1)).sqrt()
    median = rms.median(dim=-1, keepdim=True).values
    ratio = torch.log2(rms / median)
    usable = ratio.isfinite() & (median > 0) & finite.any(dim=0)
    exponent = torch.where(usable, torch.round(share * ratio), 0.0).clamp(0, MAX_FACTOR_LOG2)
    return torch.exp2(exponent).to(torch.float32)


def dequantize(codes: Tensor, scale: Tensor) -> Tensor:
    """``codes * scale`` in float64: the values a quantized pool reads back as."""
    return codes.to(torch.float64) * scale.to(torch.float64).unsqueeze(-1)


def round_rows(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` quantized per row to ``dtype`` codes and read back, in float64: what an MMA mode
    makes of its queries (no smoothing, no factors)."""
    return dequantize(*quantize(x, dtype))


def _qmax(dtype: torch.dtype) -> float:
    if dtype not in QMAX:
        raise TypeError(f"dtype must be one of {list(QMAX)}, got {dtype}")
    return QMAX[dtype]


def _prepare(x: Tensor, smooth: Tensor | None, factor: Tensor | None) -> Tensor:
    x64 = x.to(torch.float64)
    if smooth is not None:
        x64 = x64 - smooth.to(torch.float64)
    if factor is not None:
        x64 = x64 / factor.to(torch.float64)
    return x64


def _codes(x64: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``x64 / scale`` as the nearest codes of ``dtype``, saturating; zero scales give 0."""
    qmax = QMAX[dtype]
    divisor = scale.to(torch.float64).unsqueeze(-1)
    ratio = torch.where(divisor > 0, x64 / divisor.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    ratio = ratio.clamp(-qmax, qmax)
    # torch.round rounds half to even; float64 -> e4m3fn rounds to the nearest, ties to even.
    return torch.round(ratio).to(dtype) if dtype == torch.int8 else ratio.to(dtype)


def nearest_code_error(codes: Tensor, scale: Tensor, x: Tensor, dtype: torch.dtype) -> Tensor:
    """How far each stored code is from the best one, in units of half a code step (<= 1 is ok).

    Rounding may differ from :func:`quantize` where ``x / scale`` lies within float32 rounding
    of a tie, so kernels are checked with this rather than bit for bit on a GPU.
    """
    best, _ = quantize(x, dtype)
    exact = x.to(torch.float64) / scale.to(torch.float64).clamp_min(1e-300).unsqueeze(-1)
    step = _code_step(best.to(torch.float64), dtype)
    error = (codes.to(torch.float64) - exact.clamp(-QMAX[dtype], QMAX[dtype])).abs()
    return torch.where(scale.unsqueeze(-1) > 0, error / (step / 2), codes.to(torch.float64).abs())


def _code_step(codes: Tensor, dtype: torch.dtype) -> Tensor:
    """The spacing of codes around ``codes`` (1 for int8; e4m3's 3-bit mantissa ulp)."""
    if dtype == torch.int8:
        return torch.ones_like(codes)
    # frexp, not floor(log2): CUDA's float64 log2 of a power of two can fall just below the
    # integer (log2(64) -> 5.999...), which would halve the step of every code 2**k.
    _, exponent = torch.frexp(codes.abs().clamp_min(2.0**-6))
    return torch.exp2((exponent - 1 - 3).to(codes.dtype))
