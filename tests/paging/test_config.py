"""The configuration: validation per field, and the fixed widths derived from it by hand."""

from __future__ import annotations

import pytest

from paging import PagingConfig, paging_block_size, window

VALID = dict(block_size=4, chunk_size=6, window_chunks=2)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_size", 0),
        ("chunk_size", 0),
        ("window_chunks", 0),
        ("sink_chunks", -1),
        ("max_forward_chunks", 0),
        ("max_forward_chunks", 3),  # longer than the window
        ("max_action_tokens", -1),
    ],
)
def test_invalid_value_names_the_field(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        PagingConfig(**{**VALID, field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("chunk_size", 6.0),
        ("block_size", True),
        ("reset_at_boundary", 1),
        ("reuse_history_staging", "yes"),
        ("exact_window", None),
        ("compaction", 0),
    ],
)
def test_wrong_type_names_the_field(field: str, value: object) -> None:
    with pytest.raises(TypeError, match=field):
        PagingConfig(**{**VALID, field: value})


def test_widths_worked_by_hand(ragged_config: PagingConfig) -> None:
    # S = 6, W = 12, B = 4, gcd(6, 4) = 2: ceil(6/4) = 2 sink blocks, ceil((12 + 2)/4) = 4
    # recent blocks, ceil(5/4) = 2 action blocks.
    assert window.sink_blocks(ragged_config) == 2
    assert window.max_video_blocks(ragged_config) == 6
    assert window.action_blocks(ragged_config) == 2
    assert window.table_width(ragged_config) == 8
    assert window.compaction_unit(ragged_config) == 12
    # Peak: 2 sink blocks + ceil((12 + 6 + 2)/4) = 5; scratch: ceil(6/4) + ceil(5/4) = 4.
    assert window.blocks_per_sequence(ragged_config) == 7
    assert window.scratch_blocks_per_sequence(ragged_config) == 4


def test_no_actions_still_reserve_one_action_block() -> None:
    # Aligned (C = B = 8): the recent range starts on a block edge, gcd = 8 adds no block.
    config = PagingConfig(block_size=8, chunk_size=8, window_chunks=3, sink_chunks=1)
    assert window.max_video_blocks(config) == 1 + 3
    assert window.table_width(config) == 5


def test_shipped_width() -> None:
    config = PagingConfig(
        block_size=16, chunk_size=1560, sink_chunks=9, window_chunks=9, max_forward_chunks=3
    )
    # ceil(14040/16) = 878, ceil((14040 + 16 - 8)/16) = 878, one action block.
    assert window.table_width(config) == 878 + 878 + 1


@pytest.mark.parametrize(
    ("frame", "supported", "expected"),
    [
        (1560, range(16, 4097, 16), 16),  # 1560 = 97.5 blocks of 16: the finest legal size
        (1600, range(16, 4097, 16), 1600),  # a frame that is a legal size is the block
        (220, [256, 512], 256),
        (1560, None, 1560),  # this project's kernels take any size
        (7, [7], 7),
    ],
)
def test_paging_block_size(frame: int, supported, expected: int) -> None:
    assert paging_block_size(frame, supported) == expected


@pytest.mark.parametrize(
    ("frame", "supported", "error", "name"),
    [
        (0, None, ValueError, "tokens_per_frame"),
        (16.0, None, TypeError, "tokens_per_frame"),
        (16, [], ValueError, "supported"),
        (16, [0, 16], ValueError, "supported"),
    ],
)
def test_paging_block_size_bad_input(frame, supported, error, name) -> None:
    with pytest.raises(error, match=name):
        paging_block_size(frame, supported)
