"""``reference.regrow``: the factors regrow at 4x, per head, to the elementwise maximum; stored
codes are restated ties to even; a sequence that never grows stores what frozen factors store."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from paged_video.reference import quantize as rq
from paged_video.reference import regrow

INT8 = torch.int8
Quantize = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Choose = Callable[[torch.Tensor], torch.Tensor]


def constant_rows(
    tokens: int, heads: int, dim: int, gains: dict[tuple[int, int], float]
) -> torch.Tensor:
    """Rows of +-1 (random signs), channel ``(head, channel)`` times its gain: each channel's
    RMS is its gain, the median channel's 1."""
    generator = torch.Generator().manual_seed(tokens + heads)
    signs = torch.randint(0, 2, (tokens, heads, dim), generator=generator) * 2.0 - 1
    for (head, channel), gain in gains.items():
        signs[:, head, channel] *= gain
    return signs


def test_a_head_grows_only_at_four_times_a_factor() -> None:
    frozen = torch.tensor([[1.0, 2.0, 1.0, 1.0]] * 3)
    candidate = torch.tensor(
        [[2.0, 4.0, 2.0, 1.0], [1.0, 1.0, 4.0, 1.0], [1.0, 8.0, 1.0, 1.0]]
    )  # 2x at most; 4x on a factor of 1; 4x on a factor of 2
    new, grown = regrow.grow(frozen, candidate, rows=64)
    assert grown.tolist() == [False, True, True]
    assert torch.equal(new[0], frozen[0])


def test_a_write_of_fewer_than_64_rows_never_grows() -> None:
    frozen = torch.ones(1, 4)
    candidate = torch.tensor([[1.0, 256.0, 1.0, 1.0]])
    assert not regrow.grow(frozen, candidate, rows=63)[1].any()
    assert torch.equal(regrow.grow(frozen, candidate, rows=63)[0], frozen)
    assert regrow.grow(frozen, candidate, rows=64)[1].all()
    rows = constant_rows(63, 1, 8, {(0, 2): 64.0})
    assert not regrow.regrown_factors(torch.ones(1, 8), rows, share=1.0)[1].any()
    rows = constant_rows(64, 1, 8, {(0, 2): 64.0})
    assert regrow.regrown_factors(torch.ones(1, 8), rows, share=1.0)[0][0, 2] == 64.0


def test_grown_factors_are_the_elementwise_maximum() -> None:
    frozen = torch.tensor([[4.0, 1.0, 2.0, 1.0]])
    candidate = torch.tensor([[1.0, 16.0, 2.0, 2.0]])
    new, grown = regrow.grow(frozen, candidate, rows=100)
    assert grown.tolist() == [True]
    assert new.tolist() == [[4.0, 16.0, 2.0, 2.0]] and new.dtype == torch.float32


def test_the_candidate_is_chosen_from_the_rows_by_the_share() -> None:
    # K's share 1/2: a channel 4x wider asks for a factor of 2 (no growth), 16x for 4.
    frozen = torch.ones(2, 8)
    rows = constant_rows(64, 2, 8, {(0, 3): 4.0, (1, 5): 16.0})
    new, grown = regrow.regrown_factors(frozen, rows, share=rq.K_SHARE)
    assert grown.tolist() == [False, True]
    expected = torch.ones(2, 8)
    expected[1, 5] = 4.0
    assert torch.equal(new, expected)
    # Smoothing is subtracted first: a mean that cancels the wide channel leaves nothing.
    smooth = torch.zeros(2, 8)
    smoothed = rows.clone()
    smoothed[:, 1, 5] = 16.0
    smooth[1, 5] = 16.0
    _, grown = regrow.regrown_factors(frozen, smoothed, smooth=smooth, share=rq.K_SHARE)
    assert grown.tolist() == [False, False]


def test_codes_halve_ties_to_even() -> None:
    codes = torch.tensor([[[5, 7, -5, -7, 3, 127, -128, 1]]], dtype=INT8)
    frozen = torch.ones(1, 8)
    new = torch.full((1, 8), 2.0)
    assert regrow.regrow_codes(codes, frozen, new).tolist() == [[[2, 4, -2, -4, 2, 64, -64, 0]]]
    new[0, :2] = 8.0  # 5 / 8 = 0.625 -> 1; 7 / 8 -> 1
    assert regrow.regrow_codes(codes, frozen, new)[0, 0, :2].tolist() == [1, 1]


def test_regrow_codes_refuses_shrinking_factors_and_other_codes() -> None:
    codes = torch.zeros(3, 1, 4, dtype=INT8)
    with pytest.raises(ValueError, match="new must be at least frozen"):
        regrow.regrow_codes(codes, torch.full((1, 4), 2.0), torch.ones(1, 4))
    with pytest.raises(TypeError, match="codes must be int8"):
        regrow.regrow_codes(codes.float(), torch.ones(1, 4), torch.ones(1, 4))


def int8_writes(smooth: torch.Tensor | None = None) -> tuple[Quantize, Choose]:
    """``reference.quantize``'s int8 rows and K's factors, minus ``smooth``."""

    def quantize(rows: torch.Tensor, factor: torch.Tensor):
        return rq.quantize(rows, INT8, smooth=smooth, factor=factor)

    def choose(rows: torch.Tensor) -> torch.Tensor:
        return rq.channel_factors(rows, smooth=smooth, share=rq.K_SHARE)

    return quantize, choose


def test_a_sequence_that_never_grows_stores_the_frozen_factors_codes_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(0)
    gain = torch.ones(2, 16)
    gain[0, 3] = gain[1, 9] = 30.0  # wide from the first write on: chosen, never regrown
    rows = torch.randn(4 * 64, 2, 16, generator=generator) * gain
    smooth = rows[:64].mean(dim=0)
    quantize, choose = int8_writes(smooth)
    replayed = regrow.replay_writes(rows.split(64), quantize, choose)
    factor = choose(rows[:64])
    assert factor[0, 3] > 1 and not replayed.grown.any()
    frozen_codes, frozen_scale = quantize(rows, factor)
    assert torch.equal(replayed.codes, frozen_codes) and torch.equal(replayed.scale, frozen_scale)
    assert torch.equal(replayed.factor, factor)
    not_regrown = regrow.replay_writes(rows.split(64), quantize, choose, regrow=False)
    assert torch.equal(not_regrown.codes, frozen_codes)


def test_a_grown_head_restates_what_is_stored_and_writes_under_the_new_factors() -> None:
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(3 * 64, 2, 16, generator=generator)
    rows[64:, 1, 5] *= 100.0  # head 1's channel 5 grows after the first write
    quantize, choose = int8_writes()
    writes = rows.split(64)
    replayed = regrow.replay_writes(writes, quantize, choose)
    assert replayed.grown.tolist() == [[False, False], [False, True], [False, False]]
    first = choose(writes[0])
    new = regrow.grow(first, choose(writes[1]), rows=64)[0]
    assert torch.equal(replayed.factor, new) and new[1, 5] >= 4 * first[1, 5]
    assert torch.equal(new[0], first[0])
    codes, scale = quantize(writes[0], first)
    assert torch.equal(replayed.codes[:64, 0], codes[:, 0])  # head 0 untouched
    assert torch.equal(replayed.codes[:64], regrow.regrow_codes(codes, first, new))
    assert torch.equal(replayed.scale[:64], scale)  # scales unchanged
    later_codes, later_scale = quantize(rows[64:], new)
    assert torch.equal(replayed.codes[64:], later_codes)
    assert torch.equal(replayed.scale[64:], later_scale)
    # What the first write's codes stand for moves by half a code step at most.
    before = rq.dequantize(codes, scale) * first
    after = rq.dequantize(replayed.codes[:64], replayed.scale[:64]) * new
    step = scale.to(torch.float64)[..., None] * new
    assert ((after - before).abs() <= step / 2).all()
    # Without regrowth the first factors stay and the later rows are stored under them.
    frozen = regrow.replay_writes(writes, quantize, choose, regrow=False)
    assert torch.equal(frozen.factor, first) and not frozen.grown.any()
    assert torch.equal(frozen.codes, quantize(rows, first)[0])
