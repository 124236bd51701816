"""Float64 oracle of equalization factors that regrow: what a quantized pool stores when a
layer's channels grow wider after the write that chose its factors.

The first write chooses the factors (``reference.quantize.channel_factors``). Every later write
that is given them (a layer whose factors are chosen) first takes the factors of its own rows
(the candidate, by the same rule); a KV head grows where any channel's candidate is at least
``2**REGROW_LOG2`` times its factor, in a write of ``REGROW_MIN_ROWS`` rows or more (the
kernel's rule, ``kernels.regrow``). A grown head's factors become the elementwise maximum of
the two (each still a power of two, never smaller), and every code already stored for that head
is multiplied by ``old / new`` (a power of two <= 1, exact) and rounded to an integer, ties to
even, under its slot's unchanged scale: the value it stands for, code x scale x factor, stays
the same up to that rounding. Then the write quantizes its rows with the new factors. A head
that does not grow keeps its factors and its codes bit for bit, so a sequence that never grows
stores what frozen factors store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from paged_video.reference.quantize import channel_factors

# A head's factors regrow where a later write's candidate is 2**2 = 4x a channel's factor or more,
# in a write of 64 rows or more: a smaller growth, or a few rows' widths, would rewrite the pool
# for noise.
REGROW_LOG2 = 2
REGROW_MIN_ROWS = 64


def grow(frozen: Tensor, candidate: Tensor, *, rows: int) -> tuple[Tensor, Tensor]:
    """``(new, grown)`` of the factors ``frozen`` and the ``candidate`` of a later write of
    ``rows`` rows (both ``(heads, head_dim)``): ``grown (heads,)`` where any channel's
    candidate is at least ``2**REGROW_LOG2`` x its frozen factor and ``rows >=
    REGROW_MIN_ROWS``; ``new``: the elementwise maximum in grown heads, ``frozen`` elsewhere
    (float32, as the factors are)."""
    if frozen.shape != candidate.shape or frozen.dim() != 2:
        raise ValueError(
            f"frozen and candidate must both be (heads, head_dim), got {tuple(frozen.shape)} "
            f"and {tuple(candidate.shape)}"
        )
    frozen64, candidate64 = frozen.to(torch.float64), candidate.to(torch.float64)
    grown = (candidate64 >= frozen64 * 2.0**REGROW_LOG2).any(dim=-1) & (rows >= REGROW_MIN_ROWS)
    new = torch.where(grown[:, None], torch.maximum(frozen64, candidate64), frozen64)
    return new.to(torch.float32), grown


def regrown_factors(
    frozen: Tensor, rows: Tensor, *, smooth: Tensor | None = None, share: float
) -> tuple[Tensor, Tensor]:
    """:func:`grow` of ``frozen`` and the candidate factors of the write ``rows (tokens, heads,
    head_dim)`` (minus ``smooth``; ``share``: ``K_SHARE`` for keys), chosen by
    ``channel_factors``."""
    candidate = channel_factors(rows, smooth=smooth, share=share)
    return grow(frozen, candidate, rows=rows.shape[0])


def regrow_codes(codes: Tensor, frozen: Tensor, new: Tensor) -> Tensor:
    """Int8 ``codes (..., heads, head_dim)`` stored under the factors ``frozen``, restated under
    ``new`` (both ``(heads, head_dim)``, ``new / frozen`` a power of two >= 1):
    ``round(code x frozen / new)``, ties to even; the row scales stay as they are."""
    if codes.dtype != torch.int8:
        raise TypeError(f"codes must be int8 (the regrowing pools' codes), got {codes.dtype}")
    if not bool((new >= frozen).all()):
        raise ValueError("new must be at least frozen everywhere (factors only grow)")
    return _restated(codes, frozen, new)


def _restated(codes: Tensor, frozen: Tensor, new: Tensor) -> Tensor:
    """:func:`regrow_codes` without its checks (no sync: :func:`grow`'s factors only grow)."""
    ratio = frozen.to(torch.float64) / new.to(torch.float64)
    # code x 2**-k is exact in float64; torch.round rounds half to even.
    return torch.round(codes.to(torch.float64) * ratio).to(torch.int8)


class Replayed(NamedTuple):
    """What a pool holds after :func:`replay_writes`: the codes and scales of every row, in
    write order, under ``factor``, and per write ``(writes, heads)`` which heads grew."""

    codes: Tensor
    scale: Tensor
    factor: Tensor
    grown: Tensor


def replay_writes(
    writes: Sequence[Tensor],
    quantize: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]],
    choose: Callable[[Tensor], Tensor],
    *,
    regrow: bool = True,
) -> Replayed:
    """The rows ``writes`` (each ``(tokens, heads, head_dim)``, every row with a slot) written
    one after another: the first chooses the factors (``choose(rows) -> (heads, head_dim)``);
    each later one, when ``regrow``, regrows them from ``choose(rows)`` (:func:`grow`) and
    restates the codes stored so far (:func:`regrow_codes`); each then stores
    ``quantize(rows, factor) -> (codes, scale)`` (the write's smoothing is the callables' own).
    ``regrow=False``: the factors stay frozen at the first write's."""
    if not writes:
        raise ValueError("writes must hold at least one write")
    factor = choose(writes[0])
    heads = factor.shape[0]
    codes: list[Tensor] = []
    scales: list[Tensor] = []
    grown_per_write = [torch.zeros(heads, dtype=torch.bool, device=factor.device)]
    for index, rows in enumerate(writes):
        if index and regrow:
            new, grown = grow(factor, choose(rows), rows=rows.shape[0])
            grown_per_write.append(grown)
            # A head that did not grow keeps its factors, so its codes come back as they were.
            codes = [_restated(stored, factor, new) for stored in codes]
            factor = new
        elif index:
            grown_per_write.append(torch.zeros_like(grown_per_write[0]))
        stored, scale = quantize(rows, factor)
        codes.append(stored)
        scales.append(scale)
    return Replayed(torch.cat(codes), torch.cat(scales), factor, torch.stack(grown_per_write))
