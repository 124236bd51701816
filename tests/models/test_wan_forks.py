"""Forked futures of a Wan rollout against separate rollouts that each regenerate the history.

``generate(noise, ..., fork_after=b)`` with ``K`` rows generates the first ``b`` blocks once,
forks, and batches the ``K`` futures (each its own noise and actions) in one model forward and
one attention launch per step. Each future's latents must equal a rollout of its row alone,
which regenerates the shared blocks itself: bitwise on the shared blocks (the same forwards),
and within 1e-5 after the fork (measured: 1.2e-6 on latents of size ~1). Not bitwise there: the
model now runs a batch of ``K`` futures, and the stock model's matmuls round a row differently
in a batch of 6 than of 2 (4.8e-7 on one forward); attention itself is row by row and bitwise
(``tests/paging/test_forks.py``). Futures that wrote one shared tail block (no copy) would move
the latents by 3e-2. Frames of 24 tokens on 16-token blocks: the history ends mid-block, so the
futures' first forwards copy the shared tail block. The kernels take the plain-PyTorch path
(row by row, as the GPU kernel is): what is tested is the forking, not the kernels.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from paged_video.models.wan_paged import PagedWanRollout
from paged_video.paging import PagingConfig
from tests.models.tiny import TOKENS_PER_FRAME, poison, rollout_inputs, tiny_wan
from tests.paging.twin import plain_torch_kernels

BLOCKS, FORK_AFTER, FUTURES = 3, 1, 3
CONFIG = PagingConfig(
    block_size=16,
    chunk_size=TOKENS_PER_FRAME,
    sink_chunks=1,
    window_chunks=2,
    max_action_tokens=3,
    exact_window=True,
)
COMMON = dict(frames_per_block=1, sigmas=(1.0, 0.5), guidance_scale=3.0)


def futures_inputs():
    """Noise and actions of ``FUTURES`` rows that agree on the first ``FORK_AFTER`` blocks."""
    rows = [rollout_inputs(1, blocks=BLOCKS, action_tokens=2, seed=seed) for seed in (1, 2, 3)]
    noise = torch.cat([row.noise for row in rows])
    actions = torch.stack([row.actions for row in rows])
    noise[1:, :, :FORK_AFTER] = noise[0, :, :FORK_AFTER]
    actions[1:, :FORK_AFTER] = actions[0, :FORK_AFTER]
    return noise, actions, rows[0].prompt, rows[0].negative


def test_forked_futures_equal_separate_rollouts() -> None:
    model = tiny_wan(0)
    noise, actions, prompt, negative = futures_inputs()
    with plain_torch_kernels(), PagedWanRollout(model, CONFIG, session_capacity=FUTURES) as rollout:
        poison(rollout.cache)
        free = rollout.cache.pool.num_free
        forked = rollout.generate(
            noise, prompt, negative, actions=actions, fork_after=FORK_AFTER, **COMMON
        )
        assert rollout.cache.pool.num_free == free  # every future's session was closed
    with plain_torch_kernels(), PagedWanRollout(model, CONFIG) as rollout:
        poison(rollout.cache)
        separate = [
            rollout.generate(noise[k : k + 1], prompt, negative, actions=actions[k], **COMMON)
            for k in range(FUTURES)
        ]
    shared = slice(0, FORK_AFTER)
    for k, alone in enumerate(separate):
        assert not torch.isnan(forked.latents[k]).any()
        assert torch.equal(forked.latents[k, :, shared], alone.latents[0, :, shared])
        torch.testing.assert_close(forked.latents[k], alone.latents[0], atol=1e-5, rtol=1e-5)
    # The futures differ (their own noise and actions), and read the same positions as alone.
    assert (forked.latents[1] - forked.latents[2]).abs().max() > 0.1
    for block in range(FORK_AFTER, BLOCKS):
        alone_reads = (s.reads[block] for s in separate)
        for forward, *alone in zip(forked.reads[block], *alone_reads, strict=True):
            for k in range(FUTURES):
                for branch in ("positive", "negative"):
                    assert forward.positions[(k, branch)] == alone[k].positions[branch]
    # The first forward after the fork: the futures share the history's full block; each reads
    # its own copy of the half-written tail block but the last holder, which keeps it.
    first = forked.reads[FORK_AFTER][0].blocks
    history = [first[(k, "positive")][:2] for k in range(FUTURES)]  # 1 frame: 24 tokens
    assert history[0][0] == history[1][0] == history[2][0]
    assert len({h[1] for h in history}) == FUTURES


def test_futures_refuse_what_they_cannot_run() -> None:
    model = tiny_wan(0)
    noise, actions, prompt, negative = futures_inputs()
    with PagedWanRollout(model, CONFIG, session_capacity=2) as rollout:
        free = rollout.cache.pool.num_free
        cases = [
            ({}, "fork_after"),  # K rows, no fork point
            ({"fork_after": FORK_AFTER}, "session_capacity"),  # 3 futures, 2 sessions
            ({"fork_after": 5}, "fork_after"),
        ]
        for kwargs, match in cases:
            with pytest.raises(ValueError, match=match):
                rollout.generate(noise, prompt, negative, **COMMON, **kwargs)
        diverging = noise[:2].clone()
        diverging[1, :, 0] += 1  # the rows differ in the shared block
        with pytest.raises(ValueError, match="agree"):
            rollout.generate(diverging, prompt, negative, fork_after=FORK_AFTER, **COMMON)
        with pytest.raises(ValueError, match="agree"):
            rollout.generate(
                noise[:2], prompt, negative, actions=actions[[1, 0]], fork_after=2, **COMMON
            )
        assert rollout.cache.pool.num_free == free and not rollout.cache.sessions
