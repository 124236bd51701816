"""Forward plans: where tokens go, what is read, fixed shapes, and when commits happen."""

from __future__ import annotations

import dataclasses

import torch

from paged_video.paging import NULL_BLOCK, PagedKVCache, PagingConfig, PlanState
from tests.paging.rollout import Rollout, snapshot


def slots(blocks: list[int], b: int, first: int = 0, count: int | None = None) -> list[int]:
    """Slots ``first ..`` of the concatenated blocks (``block * b + offset``)."""
    every = [block * b + offset for block in blocks for offset in range(b)]
    return every[first : None if count is None else first + count]


def test_prepare_is_lazy_and_idempotent(ragged_config: PagingConfig) -> None:
    cache = PagedKVCache(ragged_config, num_layers=2, num_kv_heads=1, head_dim=2)
    session = cache.open_session()
    before = snapshot(cache)
    plan = cache.plan(session, "main", 6, commit=True)
    assert plan.state is PlanState.NEW and plan.inputs is None
    assert snapshot(cache) == before  # nothing allocated until prepared
    inputs = plan.prepare()
    assert cache.pool.num_held == 2  # ceil(6 / 4) blocks
    assert plan.prepare() is inputs and cache.pool.num_held == 2


def test_committing_forward_follows_the_history(ragged_config: PagingConfig) -> None:
    rollout = Rollout(ragged_config)
    session = rollout.open()
    seq = session.sequences["main"]
    rollout.step(session)  # history 6: entries 0, 1; entry 1 has a free tail at offsets 2, 3
    tail = seq.block_table[1]
    record = rollout.forward(session, commit=True)
    new = seq.block_table[2]
    # Positions 6 .. 11: offsets 2, 3 of the tail block, then a whole new block.
    assert record.plan.inputs.video_slots.tolist() == [tail * 4 + 2, tail * 4 + 3, *slots([new], 4)]
    assert len(seq.block_table) == 3 and seq.pending is record.plan


def test_scratch_chunk_continues_the_history_tail(ragged_config: PagingConfig) -> None:
    rollout = Rollout(ragged_config)
    session = rollout.open()
    rollout.step(session)
    seq = session.sequences["main"]
    before = snapshot(rollout.cache)
    record = rollout.forward(session)
    scratch = list(rollout.cache.scratch_blocks(session, "main"))
    tail = seq.block_table[1]
    got = record.plan.inputs.video_slots.tolist()
    assert got[0] == tail * 4 + 6 % 4  # tail * B + history % B
    assert got == [tail * 4 + 2, tail * 4 + 3, *slots(scratch[:1], 4)]
    row = record.plan.inputs.block_table[0].tolist()
    assert row[:3] == [*list.copy(seq.block_table), scratch[0]]
    assert snapshot(rollout.cache) == before  # a scratch forward changes no committed state
    assert record.plan.commit() is False and snapshot(rollout.cache) == before


def test_scratch_chunk_on_a_block_edge_starts_at_scratch_block_0() -> None:
    config = PagingConfig(block_size=4, chunk_size=8, window_chunks=2, sink_chunks=1)
    rollout = Rollout(config)
    session = rollout.open()
    rollout.step(session)
    scratch = list(rollout.cache.scratch_blocks(session, "main"))
    record = rollout.forward(session)
    assert record.plan.inputs.video_slots.tolist() == slots(scratch[:2], 4)
    assert all(block > rollout.cache.pool.num_blocks for block in scratch)


def test_action_blocks_after_the_scratch_video_blocks() -> None:
    config = PagingConfig(
        block_size=4, chunk_size=8, window_chunks=2, sink_chunks=1, max_action_tokens=5
    )
    rollout = Rollout(config)
    session = rollout.open()
    rollout.step(session)
    seq = session.sequences["main"]
    scratch = list(rollout.cache.scratch_blocks(session, "main"))
    scratch_forward = rollout.forward(session, actions=5).plan.inputs
    # Video in scratch blocks 0, 1; actions from scratch block 2.
    assert scratch_forward.video_slots.tolist() == slots(scratch[:2], 4)
    assert scratch_forward.action_slots.tolist() == slots(scratch[2:4], 4, 0, 5)
    assert scratch_forward.block_table[0, :6].tolist() == [*list.copy(seq.block_table), *scratch]
    assert scratch_forward.seq_lens_k.tolist() == [8 + 8 + 5]
    assert scratch_forward.cu_seqlens_q.tolist() == [0, 8]  # actions are keys, not queries
    # A committing forward's actions start at scratch block 0.
    committing = rollout.forward(session, commit=True, actions=5).plan.inputs
    assert committing.action_slots.tolist() == slots(scratch[:2], 4, 0, 5)
    assert committing.block_table[0, 4:6].tolist() == scratch[:2]


def test_actions_fill_the_free_tail_of_the_last_video_block(ragged_config: PagingConfig) -> None:
    # History 0: the 6 video tokens fill scratch block 0 and half of block 1; the read must stay
    # continuous, so actions take offsets 2, 3 of block 1 and then block 2.
    rollout = Rollout(ragged_config)
    session = rollout.open()
    scratch = list(rollout.cache.scratch_blocks(session, "main"))
    inputs = rollout.forward(session, actions=3).plan.inputs
    assert inputs.video_slots.tolist() == slots(scratch[:2], 4, 0, 6)
    assert inputs.action_slots.tolist() == slots(scratch[1:3], 4, 2, 3)
    assert inputs.seq_lens_k.tolist() == [9]
    # Two actions fit the free tail: no scratch block more.
    inputs = rollout.forward(session, actions=2).plan.inputs
    assert inputs.block_table[0].tolist()[:3] == [*scratch[:2], 0]


def test_fixed_width_with_a_sink_and_a_ragged_window(ragged_config: PagingConfig) -> None:
    rollout = Rollout(ragged_config)
    session = rollout.open()
    most_video = most_action = 0
    for tick in range(20):
        actions = tick % 6
        for record in (rollout.forward(session, actions=actions), rollout.step(session)):
            inputs = record.plan.inputs
            assert inputs.block_table.shape == (1, 8) and inputs.max_seqlen_k == 32
            visible = (inputs.block_table[0] != NULL_BLOCK).sum().item()
            video = -(-(inputs.seq_lens_k.item() - record.plan.action_tokens) // 4)
            most_video = max(most_video, video)
            most_action = max(most_action, visible - video)
    # Both reserves are used: 2 sink + 4 recent video blocks (the recent range starting 2 slots
    # into a block), and 2 action-only blocks (5 actions after a video ending on a block edge).
    assert (most_video, most_action) == (6, 2)


def test_key_gap_worked_by_hand(ragged_config: PagingConfig) -> None:
    # C = 6, B = 4, S = 6, W = 12. The fifth forward: history 24, end 30, recent [18, 30).
    # Reads: sink entries 0, 1 (keys 0..7: sink 0..5 + excess 6, 7), then entries 4.. from
    # position 16 (keys 8..: 16, 17 are the recent block's head). Gap = keys [6, 10).
    config = dataclasses.replace(ragged_config, exact_window=True)
    rollout = Rollout(config)
    session = rollout.open()
    gaps = [rollout.step(session).plan.inputs.key_gap.tolist() for _ in range(6)]
    assert gaps == [[[6, 6]], [[6, 6]], [[6, 6]], [[6, 8]], [[6, 10]], [[6, 8]]]
    kwargs = rollout.forward(session).plan.inputs.attention_kwargs()
    assert kwargs["key_gap"] is not None
    plain = Rollout(ragged_config)
    assert plain.forward(plain.open()).plan.inputs.attention_kwargs()["key_gap"] is None
    # C = 1, B = 4, S = 1, W = 2: history 3, end 4, recent [2, 4) starts inside the sink's
    # block 0, which holds the whole read: keys 0..3, the gap is key 1 alone.
    tiny = PagingConfig(block_size=4, chunk_size=1, sink_chunks=1, window_chunks=2)
    rollout = Rollout(dataclasses.replace(tiny, exact_window=True))
    session = rollout.open()
    gaps = [rollout.step(session).plan.inputs.key_gap.tolist() for _ in range(4)]
    assert gaps == [[[1, 1]], [[1, 1]], [[1, 1]], [[1, 2]]]


def test_commit_only_after_a_prepared_committing_forward(ragged_config: PagingConfig) -> None:
    rollout = Rollout(ragged_config)
    cache = rollout.cache
    session = rollout.open()
    seq = session.sequences["main"]
    unprepared = cache.plan(session, "main", 6, commit=True)
    before = snapshot(cache)
    assert unprepared.commit() is False and snapshot(cache) == before
    record = rollout.forward(session, commit=True)
    assert seq.committed == 0 and seq.pending is record.plan  # not committed by preparing
    assert rollout.commit(record) and seq.committed == 6 and seq.pending is None
    after = snapshot(cache)
    assert record.plan.commit() is False and snapshot(cache) == after  # no double commit
    scratch = rollout.forward(session)
    assert scratch.plan.commit() is False and snapshot(cache) == after  # a scratch forward


def test_cancel_returns_the_pending_blocks(ragged_config: PagingConfig) -> None:
    rollout = Rollout(ragged_config)
    session = rollout.open()
    rollout.step(session)
    before = snapshot(rollout.cache)
    record = rollout.forward(session, commit=True)
    assert rollout.cache.pool.num_free < before[0]
    record.plan.cancel()
    assert snapshot(rollout.cache) == before and record.plan.state is PlanState.CANCELLED
    assert record.plan.commit() is False
    rollout.step(session)  # the sequence goes on as if the cancelled forward never ran
    rollout.check_residency()


def test_layers_share_one_plan_and_pools_are_separate(ragged_config: PagingConfig) -> None:
    cache = PagedKVCache(
        ragged_config, num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32
    )
    assert cache.k_pools.shape == (3, cache.num_blocks, 4, 2, 4)
    assert cache.k_pools.untyped_storage().data_ptr() != cache.v_pools.untyped_storage().data_ptr()
    layer = cache.layer(1)
    assert layer.k_flat.shape == (cache.num_blocks * 4, 2, 4)
    layer.k_flat[7 * 4 + 3] = 5.0  # slot = block * B + offset
    assert (layer.k[7, 3] == 5.0).all() and (cache.k_pools[1, 7, 3] == 5.0).all()
    assert not (cache.layer(0).k[7, 3] == 5.0).all()
    assert layer.stage_k is None and cache.stage_k.shape == (3, 0, 2, 4)
