"""History staging: reuse on a repeated probe of the same block, full restage otherwise."""

from __future__ import annotations

import dataclasses

import torch

from paged_video.paging import PagingConfig
from tests.paging.rollout import Rollout

# C = B * 2: every chunk starts and ends on block edges. S = 8 (2 blocks), W = 16.
ALIGNED = PagingConfig(
    block_size=4,
    chunk_size=8,
    sink_chunks=1,
    window_chunks=2,
    max_action_tokens=3,
    reuse_history_staging=True,
)


def stage_from(rollout: Rollout, session, **kwargs) -> int:
    return rollout.forward(session, **kwargs).plan.stage_from


def test_buffers_are_allocated_once_per_layer() -> None:
    rollout = Rollout(ALIGNED)
    cache = rollout.cache
    # width = 2 + ceil((16 + 4 - 4)/4) + 1 = 7 blocks of 4 tokens.
    assert cache.stage_k.shape == (1, 7 * 4, 1, 4) and cache.stage_v.shape == (1, 28, 1, 4)
    assert cache.layer(0).stage_k.data_ptr() == cache.stage_k.data_ptr()
    assert cache.stage_k.data_ptr() != cache.stage_v.data_ptr()


def test_second_probe_of_the_same_block_reuses_the_history() -> None:
    rollout = Rollout(ALIGNED)
    session = rollout.open()
    rollout.step(session)  # history 8: sink entries 0, 1
    first = rollout.forward(session).plan
    assert first.stage_from == 0 and first.staging.num_blocks == 4  # first probe: everything
    # Second probe: same history blocks and lengths; restage only the chunk's 2 blocks.
    assert stage_from(rollout, session) == 2
    committing = rollout.forward(session, commit=True)
    assert committing.plan.stage_from == 2  # the committing forward keeps the same history
    rollout.commit(committing)
    assert stage_from(rollout, session) == 0  # the history moved: restage all
    assert stage_from(rollout, session) == 4  # sink 2 + history 2 blocks kept


def test_actions_another_session_or_a_ragged_chunk_restage_all() -> None:
    rollout = Rollout(ALIGNED, session_capacity=2)
    one, two = rollout.open(), rollout.open()
    rollout.step(one)
    rollout.step(two)
    assert stage_from(rollout, one) == 0
    assert stage_from(rollout, one, actions=2) == 0  # action tokens
    assert stage_from(rollout, one, actions=2) == 0  # even the same forward again
    assert stage_from(rollout, one) == 0  # the lengths differ from the forward staged last
    assert stage_from(rollout, one) == 2
    assert stage_from(rollout, two) == 0  # another session
    assert stage_from(rollout, one) == 0


def test_ragged_chunk_restages_all_on_every_probe(ragged_config: PagingConfig) -> None:
    rollout = Rollout(dataclasses.replace(ragged_config, reuse_history_staging=True))
    session = rollout.open()
    rollout.step(session)  # history 6 ends mid-block: the chunk starts in the tail block
    assert [stage_from(rollout, session) for _ in range(3)] == [0, 0, 0]


def test_cancelled_forward_is_not_reused() -> None:
    rollout = Rollout(ALIGNED)
    session = rollout.open()
    rollout.step(session)
    rollout.forward(session)
    record = rollout.forward(session, commit=True)
    record.plan.cancel()  # its forward never ran: what it would have staged is not there
    assert stage_from(rollout, session) == 0


def test_no_staging_without_the_flag(ragged_config: PagingConfig) -> None:
    rollout = Rollout(ragged_config)
    plan = rollout.forward(rollout.open()).plan
    assert plan.staging is None and plan.stage_from == -1
    assert rollout.cache.staging is None and rollout.cache.stage_k.dtype == torch.float32


def test_a_full_window_that_slides_restages_all() -> None:
    # Once the window is full every probe reads as many keys as the last, but after a commit
    # the recent blocks are other blocks: the staged history must not be kept.
    rollout = Rollout(ALIGNED)
    session = rollout.open()
    for _ in range(4):
        rollout.step(session)
    assert stage_from(rollout, session) == 0
    assert stage_from(rollout, session) == 4  # sink 2 + one recent chunk of 2 blocks
    rollout.step(session)  # reuses the history and commits: the window slides
    before = rollout.forward(session).plan
    assert before.stage_from == 0 and before.inputs.seq_lens_k.item() == 8 + 16
