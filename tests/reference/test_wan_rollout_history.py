"""reference.wan_rollout's history keeps the first forward's equalization factors, and refuses
a later forward whose rows would regrow the cache's (kernels.regrow), which it does not model."""

from __future__ import annotations

import pytest
import torch

from paged_video.reference.regrow import REGROW_MIN_ROWS
from paged_video.reference.wan_rollout import _DenseHistory


def _history() -> _DenseHistory:
    return _DenseHistory(1, 2, torch.int8, smooth_keys=True, equalize=True)


def test_a_later_forward_that_would_regrow_is_refused() -> None:
    gen = torch.Generator().manual_seed(0)
    shape = (2, REGROW_MIN_ROWS // 2, 2, 16)  # 2 rows of 32 tokens: 64 rows of the cache's write
    history = _history()
    history.choose(0, torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    chosen = history.equalizers[0]
    # Rows of the same kind: kept as they were.
    history.choose(0, torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    assert history.equalizers[0] is chosen
    wide = torch.randn(shape, generator=gen)
    wide[..., 0, :4] *= 100.0
    with pytest.raises(NotImplementedError, match="regrow the cache's K"):
        history.choose(0, wide, torch.randn(shape, generator=gen))
    with pytest.raises(NotImplementedError, match="regrow the cache's V"):
        history.choose(0, torch.randn(shape, generator=gen), wide)
    # One token fewer than the cache's minimum: the cache would not regrow either.
    short = (2, REGROW_MIN_ROWS // 2 - 1, 2, 16)
    history.choose(0, wide[:, :-1], torch.randn(short, generator=gen))
    assert history.equalizers[0] is chosen
