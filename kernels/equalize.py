"""Channel equalization of quantized K/V: per (KV head, channel) factors, chosen once.

A few channels many times wider than the rest, varying from token to token (the outlier
channels reported for keys), set every row's amax, so the other channels get only a handful of
codes; subtracting a mean does not help. Dividing each channel by a factor before quantizing
evens the channels out. Attention multiplies q by K's factors and its output by V's, so the
result is unchanged in exact arithmetic; the factors are powers of two, so also in floating
point (barring overflow). A layer's factors are chosen from its first write (K minus its
smoothing mean); a later write whose rows are many times wider regrows them, rescaling the
stored codes of that KV head (``kernels.regrow``).

The rule (``reference.quantize.channel_factors`` is its float64 oracle): per (head, channel)
the root mean square over the write's finite rows, divided by the head's median channel's; its
log2, times a share, rounded to an integer and clamped to ``[0, MAX_FACTOR_LOG2]``, is the
factor's exponent. V's share is 1: V's channels are evened out fully (the output multiply is
exact). K's is ``K_SHARE = 1/2``: what K's channels lose in width, q's gain, and the INT8-MMA mode
quantizes q rows to int8 too, so the width is split evenly between the two (SmoothQuant's
migration strength 0.5). Measured in float64 on keys with channels 20-50x wider: int8 rel L1
1.09% (dequantizing) and 1.20% (int8 queries) with the even split, 1.03% and 2.59% with K's
channels evened out fully, 3.3% and 3.4% without equalization.
"""

from __future__ import annotations

import torch
from torch import Tensor

from paged_video.kernels import _checks
from paged_video.kernels.quantize import SCALE_DTYPE

# Factors stay within [1, 2**8]: q times a factor must stay finite in float16.
MAX_FACTOR_LOG2 = 8
# The share of a channel's excess width (in log2) taken out of K and V.
K_SHARE = 0.5
V_SHARE = 1.0


def choose_factors(
    x: Tensor,
    smooth: Tensor | None = None,
    used: Tensor | None = None,
    share: float = V_SHARE,
) -> Tensor:
    """Factors ``(heads, head_dim)`` float32 of the rows ``x (tokens, heads, head_dim)`` (minus
    ``smooth``; only rows where ``used (tokens,)`` is True; ``share``: ``K_SHARE`` for keys),
    computed on ``x``'s device without a sync. A head whose median channel is 0 or not finite,
    and a channel with no finite row, get factor 1."""
    rows = x.to(SCALE_DTYPE)
    if smooth is not None:
        rows = rows - smooth
    finite = rows.isfinite()
    if used is not None:
        finite = finite & used[:, None, None]
    squares = torch.where(finite, rows, 0.0).square().sum(dim=0)
    rms = (squares / finite.sum(dim=0).clamp_min(1)).sqrt()
    median = rms.median(dim=-1, keepdim=True).values
    ratio = torch.log2(rms / median)
    usable = ratio.isfinite() & (median > 0) & finite.any(dim=0)
    exponent = torch.where(usable, torch.round(share * ratio), 0.0).clamp(0, MAX_FACTOR_LOG2)
    return torch.exp2(exponent)


def check_factor(name: str, factor: Tensor | None, pool_name: str, pool: Tensor) -> None:
    """``factor``, when given, is float32 ``(num_kv_heads, head_dim)``: ``pool``'s last two
    dimensions."""
    if factor is None:
        return
    _checks.check_tensor(name, factor)
    _checks.check_dtype(name, factor, (SCALE_DTYPE,))
    if factor.shape != pool.shape[-2:]:
        raise ValueError(
            f"{name} must have shape {tuple(pool.shape[-2:])} ({pool_name}'s num_kv_heads, "
            f"head_dim), got {tuple(factor.shape)}"
        )


def check_chosen_flag(name: str, flag: Tensor | None, needs: dict[str, Tensor | None]) -> None:
    """``flag``, when given, is a 0-dim bool CPU tensor (read without a device sync), and the
    tensors it says are chosen (``needs``) are given."""
    if flag is None:
        return
    missing = [other for other, tensor in needs.items() if tensor is None]
    if missing:
        raise ValueError(f"{name} needs {' and '.join(missing)} (what it says is chosen)")
    _checks.check_tensor(name, flag)
    _checks.check_dtype(name, flag, (torch.bool,))
    if flag.dim() != 0 or flag.device.type != "cpu":
        raise ValueError(
            f"{name} must be a 0-dim bool tensor on the CPU (read without a device sync), got "
            f"shape {tuple(flag.shape)} on {flag.device}"
        )


def check_factor_values(name: str, factor: Tensor | None) -> None:
    """Factors must be finite and positive (a zero would store infinities). Reads values: one
    device sync."""
    if factor is not None and factor.numel() and not bool((factor.isfinite() & (factor > 0)).all()):
        raise ValueError(f"{name} must be finite and > 0 everywhere")
