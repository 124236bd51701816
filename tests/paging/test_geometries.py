"""Whole rollouts at the shipped and the DreamZero-like geometry, long runs, pool sizing."""

from __future__ import annotations

import dataclasses

import pytest

from paged_video.paging import PagingConfig, paging_block_size, window
from tests.paging.rollout import Rollout, resident_model_positions

SHIPPED = PagingConfig(
    block_size=16, chunk_size=1560, sink_chunks=9, window_chunks=9, max_forward_chunks=3
)


def test_shipped_geometry() -> None:
    """C = 1560, B = 16, sink 9, window 9, 3 frames per forward, 12 committing forwards."""
    rollout = Rollout(SHIPPED, num_kv_heads=1, head_dim=1, attention_limit=0)
    session = rollout.open()
    seq = session.sequences["main"]
    widths = set()
    for tick in range(12):
        # A probe (scratch) and the committing forward of each block of 3 frames; every
        # forward is checked slot by slot against the oracle, every kept token is read.
        for record in (rollout.forward(session, chunks=3), rollout.step(session, chunks=3)):
            widths.add(record.plan.inputs.block_table.shape[1])
            assert record.plan.inputs.max_seqlen_k == 1757 * 16
        rollout.check_pool()
        rollout.check_residency()
        assert seq.absolute == 4680 * (tick + 1)
    assert widths == {1757}
    # 56160 tokens committed; dead [14040, 56160 - 14040). Without compaction the null entries
    # would be ceil(14040/16) = 878 .. floor(42120/16) - 1 = 2631: 1754 entries = 28064 tokens,
    # removed in units of lcm(1560, 16) = 3120: 8 units.
    assert seq.compacted == 8 * 3120
    assert len(seq.block_table) <= window.blocks_per_sequence(SHIPPED) + 3120 // 16 - 1


@pytest.mark.parametrize("block_size", [paging_block_size(220, range(16, 4097, 16)), 220])
def test_dreamzero_like_geometry(block_size: int) -> None:
    """C = 220, 2 frames per forward, window 36, reset at boundary, positive/negative branches."""
    config = PagingConfig(
        block_size=block_size,
        chunk_size=220,
        sink_chunks=1,
        window_chunks=36,
        max_forward_chunks=2,
        max_action_tokens=24,
        reset_at_boundary=True,
    )
    rollout = Rollout(config, branches=("positive", "negative"), attention_limit=1 << 18)
    session = rollout.open()
    for _ in range(10):
        for branch in ("positive", "negative"):
            rollout.forward(session, branch, 2, actions=24)
            record = rollout.step(session, branch, 2, actions=24)
            # Reset: a forward reads the sink frame and its own two frames, nothing else kept.
            kept = (220 if record.history else 0) + 440
            read = record.plan.inputs.seq_lens_k.item() - 24
            assert kept <= read <= kept + 2 * (block_size - 1)
        rollout.check_pool()
        rollout.check_residency()
    for seq in session.sequences.values():
        assert seq.absolute == 4400
        assert resident_model_positions(seq, config) == list(range(220))  # only the sink
    # Null entries without compaction: ceil(220/B) .. floor(4400/B) - 1; removed in whole units
    # of lcm(220, B). B = 16: 261 entries = 4176 tokens -> 4 units of 880; B = 220: 19 of 220.
    assert session.sequences["positive"].compacted == {16: 3520, 220: 4180}[block_size]


def test_pool_sizing_runs_forever() -> None:
    """Capacity sessions on every branch, all at their peak at once, never run out."""
    config = PagingConfig(
        block_size=3,
        chunk_size=5,
        sink_chunks=1,
        window_chunks=3,
        max_forward_chunks=2,
        max_action_tokens=4,
    )
    branches = ("positive", "negative")
    rollout = Rollout(config, branches=branches, session_capacity=3, attention_limit=0)
    pool = rollout.cache.pool
    assert pool.num_blocks == 3 * 2 * window.blocks_per_sequence(config)
    sessions = [rollout.open() for _ in range(3)]
    fewest_free = pool.num_blocks
    for _ in range(40):
        records = [
            rollout.forward(session, branch, 2, commit=True, actions=4)
            for session in sessions
            for branch in branches
        ]
        fewest_free = min(fewest_free, pool.num_free)  # every sequence pending at once
        for record in records:
            rollout.commit(record)
        rollout.check_pool()
    assert 0 <= fewest_free < pool.num_blocks
    for session in sessions:
        rollout.cache.close_session(session)
    assert pool.num_free == pool.num_blocks  # closing returns every block


@pytest.mark.parametrize("reset", [False, True], ids=["sliding", "reset"])
def test_long_rollout_bounded_table_same_residency_as_without_compaction(
    ragged_config: PagingConfig, reset: bool
) -> None:
    config = dataclasses.replace(ragged_config, reset_at_boundary=reset)
    compacting = Rollout(config, attention_limit=0)
    shadow = Rollout(dataclasses.replace(config, compaction=False), attention_limit=0)
    sessions = (compacting.open(), shadow.open())
    bound = window.blocks_per_sequence(config) + window.compaction_unit(config) // 4 - 1
    touches = []
    for tick in range(80):
        records = [
            r.step(s, actions=tick % 6) for r, s in zip((compacting, shadow), sessions, strict=True)
        ]
        touches.append([record.touched for record in records])
        compacting.check_residency()
        shadow.check_residency()
        seqs = [s.sequences["main"] for s in sessions]
        assert resident_model_positions(seqs[0], config) == resident_model_positions(
            seqs[1], config
        )
        assert len(seqs[0].block_table) <= bound
    assert len(sessions[1].sequences["main"].block_table) == 80 * 6 // 4  # grows without bound
    # Reading the window touches the same few entries however long the table has grown.
    assert all(a == b for a, b in touches)
    assert max(a for a, _ in touches) <= window.max_video_blocks(config)
    assert touches[-12:] == touches[-24:-12]  # periodic with lcm(C, B) = 12 tokens = 2 ticks
