"""Eviction, freed block ranges and compaction, with numbers worked by hand."""

from __future__ import annotations

import dataclasses

import pytest

from paged_video.paging import NULL_BLOCK, PagingConfig, window
from tests.paging.rollout import Rollout

# C = 10, S = 20, W = 30 (B only matters for blocks).
TEN = PagingConfig(block_size=4, chunk_size=10, sink_chunks=2, window_chunks=3)


@pytest.mark.parametrize(
    ("committed", "sliding", "reset"),
    [
        (10, 0, 0),  # inside the sink
        (20, 0, 0),  # exactly the sink
        (40, 0, 20),  # sliding: 40 <= S + W; reset: everything after the sink
        (50, 0, 30),  # sliding: exactly S + W
        (60, 10, 40),  # sliding: one whole chunk over
        (100, 50, 80),
    ],
)
def test_eviction_values(committed: int, sliding: int, reset: int) -> None:
    assert window.evicted_tokens(TEN, committed) == sliding
    assert (
        window.evicted_tokens(dataclasses.replace(TEN, reset_at_boundary=True), committed) == reset
    )


def test_sliding_eviction_never_drops_half_a_chunk() -> None:
    # A storage count that is not whole chunks (cannot happen in a rollout) still rounds down.
    assert window.evicted_tokens(TEN, 59) == 0
    assert window.evicted_tokens(TEN, 69) == 10


def test_freed_blocks_when_the_sink_ends_mid_block(ragged_config: PagingConfig) -> None:
    # C = 6, B = 4, S = 6: entry 1 holds sink tokens 4, 5 and must never be freed.
    config = dataclasses.replace(ragged_config, window_chunks=1, compaction=False)
    rollout = Rollout(config)
    session = rollout.open()
    seq = session.sequences["main"]
    nulls_after_commit = {
        6: [],  # committed 6: evicted max(0, 6 - 6 - 6) = 0
        12: [],  # evicted 0
        18: [2],  # evicted 6: dead [6, 12), entries ceil(6/4) = 2 .. floor(12/4) - 1 = 2
        24: [2, 3],  # evicted 12: dead [6, 18), entries 2 .. 3; entry 4 holds live 18, 19
        30: [2, 3, 4, 5],  # evicted 18: dead [6, 24), entries 2 .. 5
    }
    for committed, nulls in nulls_after_commit.items():
        rollout.step(session)
        assert seq.committed == committed
        table = list.copy(seq.block_table)
        assert [i for i, block in enumerate(table) if block == NULL_BLOCK] == nulls
        assert table[1] != NULL_BLOCK
        assert rollout.cache.pool.num_held == len(table) - len(nulls)
        rollout.check_pool()


def test_freed_range_formula() -> None:
    config = PagingConfig(block_size=4, chunk_size=6, sink_chunks=1, window_chunks=1)
    assert window.dead_entries(config, 0) == range(2, 2)
    assert window.dead_entries(config, 1) == range(2, 2)  # dead [6, 7): inside entry 1
    assert window.dead_entries(config, 6) == range(2, 3)
    assert window.dead_entries(config, 12) == range(2, 4)  # entry 4 still holds live 18, 19
    assert window.dead_entries(config, 18) == range(2, 6)


@pytest.mark.parametrize(
    ("reset", "expected"),
    [
        # (storage committed, compacted, evicted) after each one-chunk commit; unit lcm(6, 4) = 12
        # tokens = 3 entries, removed from the null run at entry 2 once it is that long.
        (
            False,
            [
                (6, 0, 0),
                (12, 0, 0),
                (18, 0, 6),
                (24, 0, 12),
                (18, 12, 6),
                (24, 12, 12),
                (18, 24, 6),
            ],
        ),
        (True, [(6, 0, 0), (12, 0, 6), (18, 0, 12), (12, 12, 6), (18, 12, 12), (12, 24, 6)]),
    ],
    ids=["sliding", "reset"],
)
def test_compaction_amounts(ragged_config: PagingConfig, reset: bool, expected: list) -> None:
    config = dataclasses.replace(ragged_config, window_chunks=1, reset_at_boundary=reset)
    rollout = Rollout(config)
    session = rollout.open()
    seq = session.sequences["main"]
    for tick, state in enumerate(expected, start=1):
        rollout.step(session)
        assert (seq.committed, seq.compacted, seq.evicted) == state
        assert seq.absolute == 6 * tick and seq.completed_chunks == tick
        assert len(seq.block_table) == seq.history_entries
        rollout.check_residency()


def test_recent_start_worked_by_hand(ragged_config: PagingConfig) -> None:
    # S = 6, W = 12: the last W tokens of the forward's end, never before what is evicted,
    # and empty (= end) while the sink still covers the whole forward.
    assert window.recent_start(ragged_config, 4, 0) == 4
    assert window.recent_start(ragged_config, 18, 0) == 6
    assert window.recent_start(ragged_config, 30, 6) == 18
    assert window.recent_start(ragged_config, 24, 12) == 18


def test_without_compaction_the_null_entries_stay(ragged_config: PagingConfig) -> None:
    config = dataclasses.replace(ragged_config, window_chunks=1, compaction=False)
    rollout = Rollout(config)
    session = rollout.open()
    for _ in range(7):
        rollout.step(session)
    seq = session.sequences["main"]
    assert (seq.committed, seq.compacted, seq.evicted) == (42, 0, 30)
    assert list.copy(seq.block_table)[2:9] == [0] * 7  # entries of [6, 36): evicted, kept null


def test_compactable_tokens_are_whole_units(ragged_config: PagingConfig) -> None:
    # Null entries from 2 to floor((6 + evicted)/4): 4 entries = 16 tokens -> one unit of 12.
    assert window.compactable_tokens(ragged_config, 18) == 12
    assert window.compactable_tokens(ragged_config, 12) == 0  # 2 entries = 8 tokens
    assert window.compactable_tokens(ragged_config, 30) == 24  # 7 entries = 28 tokens
