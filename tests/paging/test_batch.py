"""batch_plans: several sessions and both CFG branches as one set of attention tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paged_video.paging import PagingConfig, batch_plans
from tests.paging.rollout import Rollout


@pytest.fixture
def four_rows(ragged_config: PagingConfig):
    """Two sessions x two branches at different histories: scratch and committing rows."""
    config = dataclasses.replace(ragged_config, max_forward_chunks=2, exact_window=True)
    rollout = Rollout(config, branches=("positive", "negative"), session_capacity=2)
    one, two = rollout.open(), rollout.open()
    for _ in range(5):
        rollout.step(one, "positive")
        rollout.step(one, "negative")
    rollout.step(two, "positive", 2)
    plans = [
        rollout.forward(one, "positive", 1, actions=3).plan,
        rollout.forward(one, "negative", 2, commit=True).plan,
        rollout.forward(two, "positive", 2, actions=5).plan,
        rollout.forward(two, "negative", 1, commit=True, actions=1).plan,
    ]
    return rollout, plans


def test_every_sequence_has_scratch_blocks_of_its_own(ragged_config: PagingConfig) -> None:
    cache = Rollout(ragged_config, branches=("positive", "negative"), session_capacity=2).cache
    sessions = [cache.open_session(), cache.open_session()]
    lanes = [
        cache.scratch_blocks(session, branch)
        for session in sessions
        for branch in ("positive", "negative")
    ]
    blocks = [block for lane in lanes for block in lane]
    assert len(blocks) == len(set(blocks)) == 4 * cache.scratch_lane_blocks
    assert min(blocks) == 1 + cache.pool.num_blocks and max(blocks) == cache.num_blocks - 1
    assert [session.sequences["negative"].scratch for session in sessions] == lanes[1::2]


def test_rows_stack_and_lengths_concatenate(four_rows) -> None:
    rollout, plans = four_rows
    batch = batch_plans(plans)
    rows = [plan.inputs for plan in plans]
    assert batch.block_table.shape == (4, rollout.cache.table_width)
    assert batch.block_table.dtype == torch.int32
    for i, row in enumerate(rows):
        assert torch.equal(batch.block_table[i], row.block_table[0])
    assert batch.cu_seqlens_q.tolist() == [0, 6, 18, 30, 36]
    assert batch.cu_seqlens_q.dtype == torch.int32
    assert batch.seq_lens_k.tolist() == [row.seq_lens_k.item() for row in rows]
    assert batch.key_gap.tolist() == [row.key_gap[0].tolist() for row in rows]
    assert torch.equal(batch.video_slots, torch.cat([row.video_slots for row in rows]))
    assert torch.equal(batch.action_slots, torch.cat([row.action_slots for row in rows]))
    assert (batch.max_seqlen_q, batch.max_seqlen_k) == (12, rows[0].max_seqlen_k)
    assert batch.attention_kwargs()["key_gap"] is batch.key_gap


def test_rows_never_write_the_same_slot(four_rows) -> None:
    _, plans = four_rows
    batch = batch_plans(plans)
    written = torch.cat([batch.video_slots, batch.action_slots]).tolist()
    assert len(written) == len(set(written)) == 36 + 9


def test_single_plan_batch_is_the_plan(four_rows) -> None:
    _, plans = four_rows
    batch, row = batch_plans(plans[:1]), plans[0].inputs
    for name in ("block_table", "cu_seqlens_q", "seq_lens_k", "key_gap", "video_slots"):
        assert torch.equal(getattr(batch, name), getattr(row, name))
