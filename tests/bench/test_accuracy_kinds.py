"""``bench accuracy``'s data kinds for issue 45: each has the property it is named for."""

from __future__ import annotations

import torch

from paged_video import reference
from paged_video.bench import accuracy
from paged_video.bench.accuracy import AccuracyConfig, make_data

# Two frames of 80 keys (the first write is the first frame), 8 queries, 2 heads of 32.
SMALL = AccuracyConfig(
    heads=2, head_dim=32, chunk_size=80, sink_chunks=1, window_chunks=1, q_rows=8
)


def _gains(plain: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor:
    """Per (head, channel): how many times wider ``scaled`` is than ``plain``."""
    return (scaled.square().mean(dim=0) / plain.square().mean(dim=0)).sqrt()


def _outliers(gains: torch.Tensor) -> torch.Tensor:
    outlier = gains > 5
    assert outlier.sum(dim=1).tolist() == [accuracy.OUTLIER_CHANNELS] * SMALL.heads
    assert bool(((gains[~outlier] - 1).abs() < 0.01).all())
    return outlier


def test_k_outliers_with_q_unscaled_widen_k_and_leave_q_as_drawn() -> None:
    plain = make_data("random", SMALL)
    scaled = make_data("k-token-outliers", SMALL)
    data = make_data("k-outliers-q-unscaled", SMALL)
    assert torch.equal(data.q, plain.q) and torch.equal(data.values, plain.values)
    assert torch.equal(data.keys, scaled.keys)  # the same outlier channels and gains
    low, _ = accuracy.TOKEN_OUTLIER_GAIN
    gains = _gains(plain.keys, data.keys)
    assert bool((gains[_outliers(gains)] > low - 1).all())
    # The logits' spread grows with the gains (k-token-outliers keeps it near 1).
    logits = torch.einsum("qhd,khd->hqk", data.q, data.keys) / SMALL.head_dim**0.5
    assert logits.std() > 5


def test_k_and_v_grow_on_a_few_channels_after_the_first_frame_only() -> None:
    plain = make_data("random", SMALL)
    first, later = slice(0, SMALL.chunk_size), slice(SMALL.chunk_size, None)
    for kind in ("k-grows", "v-grows"):
        data = make_data(kind, SMALL)
        grown, base, kept = (
            (data.keys, plain.keys, data.values)
            if kind == "k-grows"
            else (data.values, plain.values, data.keys)
        )
        assert torch.equal(kept, plain.values if kind == "k-grows" else plain.keys)
        assert torch.equal(grown[first], base[first])  # the first write sees none of it
        gains = _gains(base[later], grown[later])
        outlier = _outliers(gains)
        torch.testing.assert_close(
            gains[outlier], torch.full_like(gains[outlier], accuracy.GROWTH), rtol=0.01, atol=0
        )
        if kind == "k-grows":  # q divided by the later keys' RMS gain
            rms = gains.square().mean(dim=-1).sqrt()
            torch.testing.assert_close(data.q, plain.q / rms[:, None], rtol=1e-2, atol=1e-3)
        else:
            assert torch.equal(data.q, plain.q)


def test_v_small_keys_carry_the_softmax_mass_with_tiny_values() -> None:
    config = AccuracyConfig(**{**SMALL.__dict__, "head_dim": 128})  # the logits' margin grows
    data = make_data("v-small", config)
    small = slice(0, accuracy.SMALL_V_KEYS)
    scores = torch.einsum("qhd,khd->hqk", data.q.double(), data.keys.double())
    probs = torch.softmax(scores / config.head_dim**0.5, dim=-1)
    # All but far less than the small values' own size lies on the first keys.
    assert bool((1 - probs[..., small].sum(dim=-1) < 1e-3 * accuracy.SMALL_V_SCALE).all())
    assert data.values[small].abs().max() < 10 * accuracy.SMALL_V_SCALE
    assert data.values[accuracy.SMALL_V_KEYS :].abs().mean() > 0.5
    out = reference.dense_attention(data.q, data.keys, data.values)
    assert 0 < out.abs().max() < 10 * accuracy.SMALL_V_SCALE
