"""Forked sessions: shared blocks counted in the pool, copy-on-write of a shared tail block (in
one launch too), eviction dropping references, plans a fork overtook, refused calls that write
nothing, staging per session, and what K forks of a full window cost.

Forwards run through ``ForwardCall`` on the twin (``twin.py``): the staged cache forks, the
unstaged one deep-copies, and every output must match bit for bit (NaN-poisoned pools).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from paged_video.paging import NULL_BLOCK, PagedKVCache, PagingConfig, window
from paged_video.paging.forward import ForwardCall
from tests.paging.rollout import Rollout, check_pool, snapshot
from tests.paging.twin import Twin, plain_torch_kernels

# C = 6, B = 4: a history of an odd number of frames ends half way into its tail block.
RAGGED = PagingConfig(
    block_size=4, chunk_size=6, sink_chunks=1, window_chunks=2, max_action_tokens=5
)
ALIGNED = PagingConfig(block_size=4, chunk_size=8, sink_chunks=1, window_chunks=3)
BRANCHES = ("positive", "negative")
KV_DTYPES = [None, torch.int8]


@pytest.fixture(autouse=True)
def plain():
    with plain_torch_kernels():
        yield


def rows(*sessions: int) -> list[tuple[int, str]]:
    return [(s, branch) for s in sessions for branch in BRANCHES]


def tail(session, branch: str = "positive") -> int:
    seq = session.sequences[branch]
    return seq.block_table[seq.committed // seq.config.block_size]


def stored_bytes(cache: PagedKVCache) -> list[torch.Tensor]:
    """Every byte the fused op may write: pools, scales, means, staging, and the record."""
    return [t.clone().view(torch.uint8) for t in (*cache.pool_tensors, cache.stage_tags)]


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_fork_shares_every_block_and_copies_nothing() -> None:
    pair = Twin(RAGGED, branches=BRANCHES, session_capacity=2)
    pair.open()
    for _ in range(3):
        pair.forward(rows(0), commit=True)
    cache, parent = pair.staged, pair.sessions[0][0]
    free, stored = cache.pool.num_free, stored_bytes(cache)
    child = cache.fork(parent)
    assert child.id != parent.id and child.lane != parent.lane
    for branch in BRANCHES:
        seq, forked = parent.sequences[branch], child.sequences[branch]
        assert forked.block_table == seq.block_table and forked.block_table is not seq.block_table
        assert (forked.committed, forked.compacted, forked.evicted) == (
            seq.committed,
            seq.compacted,
            seq.evicted,
        )
        assert all(cache.pool.refcount(b) == 2 for b in seq.block_table if b != NULL_BLOCK)
        assert forked.scratch != seq.scratch
    assert cache.pool.num_free == free and same_bytes(stored_bytes(cache), stored)
    held = cache.pool.num_held
    assert cache.session_blocks(child) == (0, held) == cache.session_blocks(parent)
    stats = cache.pool_stats
    assert (stats.shared, stats.exclusive, stats.references) == (held, 0, 2 * held)
    assert stats.unshared_bytes == 2 * stats.held_bytes == 2 * held * cache.block_bytes
    check_pool(cache)


FORMATS = {
    **{name: {"kv_dtype": d} for name, d in zip(("float", "int8"), KV_DTYPES, strict=True)},
    "k8v8": {"kv_format": "k8v8"},
    "k8v16": {"kv_format": "k8v16"},
}


@pytest.mark.parametrize("pools", FORMATS.values(), ids=FORMATS.keys())
def test_forks_sharing_a_tail_block_in_one_launch_equal_deep_copies(pools: dict) -> None:
    # Three sessions hold one half-written tail block; one launch over all six rows writes the
    # chunk and the actions after it. Each row but the block's last holder gets a copy first,
    # else the rows would write the same free slots and read each other's tokens. Twin.run
    # checks every output against the deep-copied sessions' and that no write lands in a
    # block another sequence holds.
    pair = Twin(dataclasses.replace(RAGGED, **pools), branches=BRANCHES, session_capacity=3)
    pair.open()
    pair.forward(rows(0), commit=True)  # 6 tokens: block 1 holds 2 of 4
    pair.fork(0)
    pair.fork(0)
    cache = pair.staged
    sessions = [s for s, _ in pair.sessions]
    shared = tail(sessions[0])
    assert cache.pool.refcount(shared) == 3
    pair.forward(rows(0, 1, 2), commit=False, actions=3)
    tails = [tail(s) for s in sessions]
    assert tails[2] == shared and len(set(tails)) == 3  # the last holder kept it
    assert all(cache.pool.refcount(block) == 1 for block in tails)
    pair.forward(rows(0, 1, 2), commit=True, actions=2)  # each writes its own tail now
    pair.forward(rows(2, 0), commit=False)


@pytest.mark.parametrize(
    "pools", [{"kv_dtype": torch.int8}, {"kv_format": "k8v8"}], ids=["int8", "k8v8"]
)
def test_committing_fork_copies_k_v_and_scales_of_every_layer(pools: dict) -> None:
    # Random codes stand for what the commits wrote: no mean or factors a write would choose
    # (a cache refuses committed tokens under an unchosen state; k8v8's V channel scales are
    # per layer, shared by every block, so set as chosen). k8v8: int8 K, keys-major e4m3 V and
    # K scales.
    cache = PagedKVCache(
        dataclasses.replace(RAGGED, **pools, smooth_keys=False, equalize_channels=False),
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        session_capacity=2,
        dtype=torch.float32,
    )
    cache.v_scales_chosen.fill_(True)
    gen = torch.Generator().manual_seed(0)
    for buffer in (cache.k_pools, cache.v_pools, cache.k_scales, cache.v_scales):
        codes = torch.randint(-100, 100, buffer.shape, generator=gen, dtype=torch.int8)
        if buffer.element_size() == 1:
            buffer.view(torch.int8).copy_(codes)
        else:  # (float scales; keys-major ones have no int8 view)
            buffer.copy_(codes)
    parent = cache.open_session()
    first = cache.plan(parent, "main", 6, commit=True)
    first.prepare()
    first.commit()
    child = cache.fork(parent)
    old = tail(child, "main")
    plan = cache.plan(child, "main", 6, commit=True)
    plan.prepare()
    new = tail(child, "main")
    assert new != old and tail(parent, "main") == old
    assert plan.tail == (1, new, old)
    assert cache.pool.refcount(old) == cache.pool.refcount(new) == 1
    stored_tensors = (cache.k_pools, cache.v_pools, cache.k_scales, cache.v_scales)
    for stored in (t for t in stored_tensors if t.numel()):  # (k8v8: no V scale per slot)
        bits = torch.int8 if stored.element_size() == 1 else stored.dtype
        assert torch.equal(stored[:, new].view(bits), stored[:, old].view(bits))
    plan.cancel()  # the forward's new blocks go back; the copy stays (same history)
    assert tail(child, "main") == new and len(child.sequences["main"].block_table) == 2
    check_pool(cache)


def test_eviction_drops_references_and_the_last_holder_frees() -> None:
    # The Rollout checks every read slot by slot: the fork reads its parent's tokens.
    rollout = Rollout(RAGGED, session_capacity=2)
    parent = rollout.open()
    for _ in range(3):
        rollout.step(parent)
    child = rollout.fork(parent)
    inherited = {b for b in list.copy(parent.sequences["main"].block_table) if b != NULL_BLOCK}
    for _ in range(4):  # past the window: the child evicts every shared block but the sink's
        rollout.step(child)
        rollout.check_pool()
        rollout.check_residency()
    parent_table = list.copy(parent.sequences["main"].block_table)
    child_blocks = set(list.copy(child.sequences["main"].block_table)) - {NULL_BLOCK}
    sink = set(parent_table[: window.sink_blocks(RAGGED)])  # 2 blocks: S = 6, B = 4
    assert set(parent_table) - {NULL_BLOCK} == inherited and child_blocks & inherited == sink
    assert all(rollout.cache.pool.refcount(b) == 1 for b in inherited - sink)
    free = rollout.cache.pool.num_free
    rollout.cache.close_session(parent)  # its blocks nobody else holds go back
    assert rollout.cache.pool.num_free == free + len(inherited - sink)
    assert all(rollout.cache.pool.refcount(b) == 1 for b in sink)
    rollout.step(child)  # still reads its own history and the sink
    rollout.cache.close_session(child)
    assert rollout.cache.pool.num_free == rollout.cache.pool.num_blocks
    assert rollout.copies == 1  # the child's first commit continued the shared tail block


def test_a_plan_prepared_before_a_fork_refuses_to_write_the_shared_tail() -> None:
    pair = Twin(RAGGED, session_capacity=2)
    pair.open()
    pair.forward([(0, "main")], commit=True)
    cache, parent = pair.staged, pair.sessions[0][0]
    overtaken = cache.plan(parent, "main", 6, action_tokens=2)
    overtaken.prepare()  # writes the tail block's free slots, which the parent held alone
    pair.fork(0)
    before, stored = snapshot(cache), stored_bytes(cache)
    with pytest.raises(ValueError, match="stale: the tail block"):
        ForwardCall(cache, overtaken, softmax_scale=0.5)
    assert snapshot(cache) == before and same_bytes(stored_bytes(cache), stored)
    pair.forward([(0, "main"), (1, "main")], commit=False, actions=2)  # new plans copy


def test_a_plan_prepared_before_a_fork_on_a_block_edge_still_runs() -> None:
    pair = Twin(ALIGNED, session_capacity=2)
    pair.open()
    pair.forward([(0, "main")], commit=True)
    cache = pair.staged
    plan = cache.plan(pair.sessions[0][0], "main", 8)
    plan.prepare()
    assert plan.tail is None  # it writes scratch blocks only
    pair.fork(0)
    ForwardCall(cache, plan, softmax_scale=0.5)


@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["float", "int8"])
def test_a_refused_call_undoes_its_tail_copy_and_writes_nothing(kv_dtype) -> None:
    pair = Twin(dataclasses.replace(RAGGED, kv_dtype=kv_dtype), session_capacity=2)
    pair.open()
    pair.forward([(0, "main")], commit=True)
    pair.fork(0)
    cache, child = pair.staged, pair.sessions[1][0]
    before, stored = snapshot(cache), stored_bytes(cache)
    twice = [cache.plan(child, "main", 6, commit=True), cache.plan(child, "main", 6)]
    with pytest.raises(ValueError, match="pending"):  # the first copied the tail block
        ForwardCall(cache, twice, softmax_scale=0.5)
    scratch = [cache.plan(child, "main", 6), cache.plan(child, "main", 6)]
    with pytest.raises(ValueError, match="twice"):
        ForwardCall(cache, scratch, softmax_scale=0.5)
    assert snapshot(cache) == before and same_bytes(stored_bytes(cache), stored)
    cache.pool.allocate(cache.pool.num_free)  # as if another user took every free block
    before = snapshot(cache)
    for commit in (True, False):
        with pytest.raises(ValueError, match="exhausted"):
            ForwardCall(cache, cache.plan(child, "main", 6, commit=commit), softmax_scale=0.5)
    assert snapshot(cache) == before and same_bytes(stored_bytes(cache), stored)


def test_staging_is_never_reused_across_forks() -> None:
    pair = Twin(ALIGNED, session_capacity=2)
    pair.open()
    for _ in range(2):
        pair.forward([(0, "main")], commit=True)
    pair.forward([(0, "main")], commit=False)  # stages the parent's history
    again = pair.plans([(0, "main")], commit=False)
    assert again[0][0].prepare().block_table is not None and again[0][0].stage_from > 0
    pair.fork(0)
    child = pair.plans([(1, "main")], commit=False)
    child[0][0].prepare()
    # The same history blocks, staged for the parent: the fork restages everything.
    assert child[0][0].stage_from == 0
    pair.run(child)


@pytest.mark.parametrize("forks", [1, 3])
def test_k_forks_of_a_full_window_cost_one_window_plus_what_each_wrote(forks: int) -> None:
    # Bookkeeping only: plans prepared and committed, nothing written.
    config = PagingConfig(block_size=4, chunk_size=6, sink_chunks=1, window_chunks=4)
    cache = PagedKVCache(
        config, num_layers=1, num_kv_heads=1, head_dim=1, session_capacity=forks + 1
    )

    def step(session) -> None:
        plan = cache.plan(session, "main", 6, commit=True)
        plan.prepare()
        plan.commit()

    parent = cache.open_session()
    for _ in range(9):  # the window is full and slides
        step(parent)
    window_blocks = cache.pool.num_held
    history = parent.sequences["main"].committed
    written = []
    for k in range(forks):
        child = cache.fork(parent)
        for _ in range(k + 1):
            step(child)
        # Blocks of the frames it wrote (none evicted yet), plus the copied tail block.
        entries = math.ceil((history + 6 * (k + 1)) / 4) - math.ceil(history / 4)
        written.append(entries + (history % 4 != 0))
        assert cache.session_blocks(child).exclusive == written[-1]
    assert history % 4 != 0  # each fork copied the tail block, and only that one
    for k, blocks in enumerate(written):
        assert blocks <= math.ceil(6 * (k + 1) / 4) + 1
    assert cache.pool_stats.held == window_blocks + sum(written)
    check_pool(cache)


def test_pool_blocks_sizes_the_pool_by_blocks() -> None:
    per_session = len(BRANCHES) * window.blocks_per_sequence(RAGGED)
    kwargs = dict(num_layers=1, num_kv_heads=1, head_dim=4, branches=BRANCHES)
    with pytest.raises(ValueError, match="pool_blocks must be >= "):
        PagedKVCache(RAGGED, session_capacity=3, pool_blocks=per_session - 1, **kwargs)
    with pytest.raises(TypeError, match="pool_blocks"):
        PagedKVCache(RAGGED, pool_blocks=float(per_session), **kwargs)
    cache = PagedKVCache(RAGGED, session_capacity=3, pool_blocks=per_session + 2, **kwargs)
    assert cache.pool.num_blocks == per_session + 2
    assert PagedKVCache(RAGGED, session_capacity=3, **kwargs).pool.num_blocks == 3 * per_session
