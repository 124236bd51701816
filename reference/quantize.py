"""Float64 oracle of quantized KV storage: what a quantized pool row should hold and reads back as.

Per row of ``head_dim`` values: ``scale = amax(|x|) / qmax`` (rounded to float32, as stored),
codes = ``x / scale`` rounded to the nearest code (ties to even), saturating at ``qmax``. A zero
row has scale 0 and codes 0. ``smooth`` (K smoothing) is subtracted first; attention is
unchanged by it, since every query sees the same shift ``q . smooth`` on all its scores.
"""

from __future__ import annotations

import torch
from torch import Tensor

QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


def quantize(
    x: Tensor, dtype: torch.dtype, *, smooth: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(codes, scale)`` of ``x (..., head_dim)``: codes in ``dtype``, a float32 scale per row."""
    if dtype not in QMAX:
        raise TypeError(f"dtype must be one of {list(QMAX)}, got {dtype}")
    qmax = QMAX[dtype]
    x64 = x.to(torch.float64)
    if smooth is not None:
        x64 = x64 - smooth.to(torch.float64)
    scale = (x64.abs().amax(dim=-1) / qmax).to(torch.float32)
    divisor = scale.to(torch.float64).unsqueeze(-1)
    ratio = torch.where(divisor > 0, x64 / divisor.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    ratio = ratio.clamp(-qmax, qmax)
    # torch.round rounds half to even; float64 -> e4m3fn rounds to the nearest, ties to even.
    codes = torch.round(ratio).to(dtype) if dtype == torch.int8 else ratio.to(dtype)
    return codes, scale


def dequantize(codes: Tensor, scale: Tensor) -> Tensor:
    """``codes * scale`` in float64: the values a quantized pool reads back as."""
    return codes.to(torch.float64) * scale.to(torch.float64).unsqueeze(-1)


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
    exponent = torch.floor(torch.log2(codes.abs().clamp_min(2.0**-6)))
    return torch.exp2(exponent - 3)
