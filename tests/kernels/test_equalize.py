"""kernels.equalize.choose_factors (float32, on the device) against the float64 oracle
reference.quantize.channel_factors, and the rule on cases worked by hand."""

from __future__ import annotations

import torch

from paged_video.kernels.equalize import K_SHARE, MAX_FACTOR_LOG2, choose_factors
from paged_video.reference.quantize import channel_factors
from tests.helpers import DEVICE


def test_a_case_worked_by_hand():
    # One head, four channels with RMS 1, 1, 3 and 1000 (median: the lower middle one, 1):
    # log2 ratios 0, 0, 1.58, 9.97 -> factors 1, 1, 4 (rounded), 2**8 (clamped).
    rows = torch.tensor([[1.0, -1.0, 3.0, 1000.0], [-1.0, 1.0, -3.0, -1000.0]])[:, None, :]
    want = torch.tensor([[1.0, 1.0, 4.0, 2.0**MAX_FACTOR_LOG2]])
    assert torch.equal(choose_factors(rows.to(DEVICE)).cpu(), want)
    assert torch.equal(channel_factors(rows), want)
    # K's share is half the log2: 0, 0, 0.79 -> 1, 4.98 -> 5.
    half = torch.tensor([[1.0, 1.0, 2.0, 32.0]])
    assert torch.equal(choose_factors(rows.to(DEVICE), share=K_SHARE).cpu(), half)
    assert torch.equal(channel_factors(rows, share=K_SHARE), half)


def test_smoothing_nan_rows_and_degenerate_heads_match_the_oracle():
    gen = torch.Generator().manual_seed(0)
    tokens, heads, dim = 40, 4, 80
    rows = torch.randn(tokens, heads, dim, generator=gen)
    gains = torch.exp2(torch.empty(heads, dim).uniform_(-3.0, 7.0, generator=gen))
    rows = rows * gains + 5.0 * torch.randn(heads, dim, generator=gen)
    mean = rows.mean(dim=0)
    rows[3, 1] = float("nan")  # a non-finite row counts for nothing
    rows[:, 2], mean[2] = 0.0, 0.0  # a head of zeros: median 0, every factor 1
    rows[:, 3, 5] = float("inf")  # a channel with no finite row: factor 1
    want = channel_factors(rows, smooth=mean, share=K_SHARE)
    got = choose_factors(rows.to(DEVICE), mean.to(DEVICE), share=K_SHARE).cpu()
    assert got.dtype == torch.float32 and got.shape == (heads, dim)
    assert torch.equal(got, want)
    assert torch.equal(got[2], torch.ones(dim)) and got[3, 5] == 1.0
    assert got.min() == 1.0 and 2.0**2 <= got.max() <= 2.0**MAX_FACTOR_LOG2
    # Smoothing matters: without the mean, the offsets dominate the RMS.
    assert not torch.equal(choose_factors(rows.to(DEVICE), share=K_SHARE).cpu(), got)


def test_equalized_outlier_channels_keep_every_channel_within_an_octave_of_the_median():
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(500, 2, 64, generator=gen)
    rows[:, :, :4] *= 35.0
    factors = choose_factors(rows.to(DEVICE)).cpu()
    assert torch.equal(factors[:, :4], torch.full((2, 4), 32.0))
    rms = (rows / factors).square().mean(dim=0).sqrt()
    median = rms.median(dim=-1, keepdim=True).values
    assert bool(((rms / median).log2().abs() <= 0.6).all())
