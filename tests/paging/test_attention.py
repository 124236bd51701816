"""End to end: plans drive ``kernels.paged_attention`` over a NaN-poisoned pool."""

from __future__ import annotations

import dataclasses

import pytest

from paged_video.paging import PagingConfig
from tests.paging.rollout import Rollout


@pytest.mark.parametrize("exact_window", [False, True], ids=["whole-blocks", "exact"])
def test_kernel_attention_matches_the_oracle_keys(
    ragged_config: PagingConfig, exact_window: bool
) -> None:
    # Window 1: the sink excess and the recent block's head are read, and hidden when exact.
    config = dataclasses.replace(ragged_config, window_chunks=1, exact_window=exact_window)
    rollout = Rollout(config, kernel_budget=1000)
    session = rollout.open()
    gaps = set()
    for tick in range(6):
        for record in (rollout.forward(session, actions=tick % 3), rollout.step(session)):
            assert record.kernel_checked  # dense attention over the oracle's keys agrees
            gaps.add(tuple(record.plan.inputs.key_gap[0].tolist()))
    assert any(lo < hi for lo, hi in gaps)  # some forward had boundary tokens to hide
