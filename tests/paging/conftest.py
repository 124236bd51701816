"""Fixtures of the paging tests."""

from __future__ import annotations

import pytest

from paged_video.paging import PagingConfig


@pytest.fixture
def ragged_config() -> PagingConfig:
    """Chunks and blocks that never line up (C = 6, B = 4, lcm 12), a sink, room for actions.

    S = 6 ends mid-block; W = 12; width = ceil(6/4) + ceil((12 + 4 - 2)/4) + ceil(5/4) = 8.
    """
    return PagingConfig(
        block_size=4, chunk_size=6, sink_chunks=1, window_chunks=2, max_action_tokens=5
    )
