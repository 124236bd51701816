"""``paging.shard``: the ranks of a sequence-sharded window read, together, exactly the keys the
single process reads, each key on one rank, and each rank stores its share of the blocks.

A single-process ``PagedKVCache`` and ``N`` ``ShardedKVCache`` ranks run the same forwards
(scratch and committing, with action tokens, over two branches and two sessions, a session
closed and reopened). Each cache keeps a label per slot: what token was last written there
(a model position, or an action token's id); a forward writes its tokens' labels at its
(local) slots, then reads the labels at its (local) row's keys, less the key gap with an exact
window. The ranks' reads must be disjoint and their union the single process's read, multiset
for multiset, boundary tokens of whole-block reads included; no rank reads an unwritten slot.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from paged_video.paging import PagedKVCache, PagingConfig, PlanState, PoolExhaustedError
from paged_video.paging.forward import ForwardCall
from paged_video.paging.shard import ShardedForwardCall, ShardedKVCache

UNWRITTEN = -1
ACTION_LABEL = 10**6  # action token a of forward f: ACTION_LABEL + 100 * f + a


class Labelled:
    """A cache and the label of each of its slots (physical slots for a shard rank)."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        slots = cache.k_pools.shape[1] * cache.config.block_size
        self.labels = torch.full((slots,), UNWRITTEN, dtype=torch.int64)

    def forward(self, plans, video: torch.Tensor, actions: torch.Tensor) -> list[list[int]]:
        """Write the tokens' labels, return each row's read labels (sorted)."""
        if isinstance(self.cache, ShardedKVCache):
            inputs = ShardedForwardCall(self.cache, plans, softmax_scale=1.0).local_inputs
        else:
            inputs = ForwardCall(self.cache, plans, softmax_scale=1.0).inputs
        for slots, labels in ((inputs.video_slots, video), (inputs.action_slots, actions)):
            written = slots >= 0
            self.labels[slots[written]] = labels[written]
        b = self.cache.config.block_size
        reads = []
        for row in range(len(plans)):
            keys = torch.arange(int(inputs.seq_lens_k[row]))
            if inputs.exact_window:
                lo, hi = inputs.key_gap[row].tolist()
                keys = keys[(keys < lo) | (keys >= hi)]
            slots = inputs.block_table[row].to(torch.int64)[keys // b] * b + keys % b
            reads.append(sorted(self.labels[slots].tolist()))
        return reads


@st.composite
def geometries(draw) -> PagingConfig:
    chunk = draw(st.sampled_from([5, 24]))
    window_chunks = draw(st.integers(1, 4))
    return PagingConfig(
        block_size=draw(st.sampled_from([1, 7, 16, 24, 48])),
        chunk_size=chunk,
        window_chunks=window_chunks,
        sink_chunks=draw(st.integers(0, 2)),
        max_forward_chunks=draw(st.integers(1, window_chunks)),
        max_action_tokens=draw(st.sampled_from([0, 3, 30])),
        reset_at_boundary=draw(st.booleans()),
        exact_window=draw(st.booleans()),
        compaction=draw(st.booleans()),
        reuse_history_staging=draw(st.booleans()),
    )


# Commits slide and compact the window (frames of 24 over blocks of 16: compaction removes 3
# blocks at a time, so a block's owner is fixed by its model position, not by its table entry).
COMPACTING = PagingConfig(
    block_size=16,
    chunk_size=24,
    window_chunks=2,
    sink_chunks=1,
    max_action_tokens=3,
    exact_window=True,
)


@given(
    config=geometries(),
    degree=st.integers(2, 3),
    steps=st.lists(
        st.tuples(
            st.integers(1, 4),
            st.sampled_from([True, True, False]),
            st.integers(0, 30),
            st.integers(0, 12),
        ),
        min_size=6,
        max_size=16,
    ),
)
@example(config=COMPACTING, degree=2, steps=[(1, True, 3, 1)] * 8)
def test_ranks_read_the_single_process_keys_once(config, degree, steps):
    def build(cls, **shard):
        cache = cls(
            config,
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            session_capacity=2,
            branches=("positive", "negative"),
            dtype=torch.float32,
            **shard,
        )
        return Labelled(cache)

    single = build(PagedKVCache)
    ranks = [build(ShardedKVCache, shard_degree=degree, shard_index=i) for i in range(degree)]
    everyone = [single, *ranks]
    sessions = [[c.cache.open_session() for c in everyone] for _ in range(2)]
    for f, (chunks, commit, actions, pick) in enumerate(steps):
        chunks = min(chunks, config.max_forward_chunks)
        actions = min(actions, config.max_action_tokens)
        lane = pick % 2
        if pick == 12:  # close a session and open a fresh one in its slot
            for c, session in zip(everyone, sessions[lane], strict=True):
                c.cache.close_session(session)
            sessions[lane] = [c.cache.open_session() for c in everyone]
        branches = ("positive", "negative") if pick % 3 else ("negative",)
        n = chunks * config.chunk_size
        reads = []
        for c, session in zip(everyone, sessions[lane], strict=True):
            plans = [
                c.cache.plan(session, br, n, commit=commit, action_tokens=actions)
                for br in branches
            ]
            starts = [session.sequences[br].absolute for br in branches]
            video = torch.cat([torch.arange(start, start + n) for start in starts])
            action_labels = torch.cat(
                [ACTION_LABEL + 100 * f + torch.arange(actions) for _ in branches]
            )
            reads.append(c.forward(plans, video, action_labels))
            for plan in plans:
                plan.commit()
        want, got = reads[0], reads[1:]
        for row in range(len(branches)):
            union = sorted(label for rank in got for label in rank[row])
            assert union == want[row], (f, branches[row])
            assert UNWRITTEN not in union
        # Every single-process block is on exactly one rank.
        held = [r.cache.storage_pool.num_held for r in ranks]
        assert sum(held) == single.cache.pool.num_held
        for r in ranks:
            assert r.cache.storage_pool.num_held == len(r.cache._physical)
    for c, pair in zip(everyone, zip(*sessions, strict=True), strict=True):
        for session in pair:
            c.cache.close_session(session)
    for r in ranks:
        assert r.cache.storage_pool.num_free == r.cache.storage_pool.num_blocks


@pytest.mark.parametrize("degree", [2, 3, 4])
def test_each_rank_stores_its_share_of_the_window(degree):
    # The shipped-like small CFG model: 2 branches, frames of 220 tokens, window 36, blocks of 16.
    config = PagingConfig(
        block_size=16, chunk_size=220, window_chunks=36, max_forward_chunks=2, exact_window=True
    )
    geometry = dict(num_layers=1, num_kv_heads=2, head_dim=8, branches=("pos", "neg"))
    single = PagedKVCache(config, **geometry)
    shards = [
        ShardedKVCache(config, shard_degree=degree, shard_index=i, **geometry)
        for i in range(degree)
    ]
    pool_blocks = single.pool.num_blocks
    for shard in shards:
        # At most one block per sequence (2) over an even share, for the pool and scratch.
        assert shard.storage_pool.num_blocks <= -(-pool_blocks // degree) + 2
        assert shard.storage_blocks * degree <= single.num_blocks + 4 * degree
        per_block = shard.pool_bytes // shard.storage_blocks
        assert shard.pool_bytes <= single.pool_bytes / degree + 4 * per_block
        assert shard.table_width <= -(-single.table_width // degree) + 1


def test_shard_index_and_degree_are_checked():
    config = PagingConfig(block_size=4, chunk_size=4, window_chunks=2)
    geometry = dict(num_layers=1, num_kv_heads=1, head_dim=1)
    with pytest.raises(ValueError, match="shard_index must be < shard_degree"):
        ShardedKVCache(config, shard_degree=2, shard_index=2, **geometry)
    with pytest.raises(ValueError, match="shard_degree"):
        ShardedKVCache(config, shard_degree=0, shard_index=0, **geometry)
    with pytest.raises(TypeError, match="cache must be a ShardedKVCache"):
        cache = PagedKVCache(config, **geometry)
        ShardedForwardCall(cache, cache.plan(cache.open_session(), "main", 4), softmax_scale=1.0)


def test_a_refused_call_gives_back_every_block():
    # No physical block is left for a committing forward's new block of this rank: the call
    # refuses, and the single-process plan it prepared is undone (its block back in the pool).
    config = PagingConfig(block_size=4, chunk_size=4, window_chunks=2)
    cache = ShardedKVCache(
        config, shard_degree=2, shard_index=0, num_layers=1, num_kv_heads=1, head_dim=1
    )
    session = cache.open_session()
    taken = cache.storage_pool.allocate(cache.storage_pool.num_free)
    free = cache.pool.num_free
    plan = cache.plan(session, "main", 4, commit=True)  # block at position 0: this rank's
    with pytest.raises(PoolExhaustedError):
        ShardedForwardCall(cache, plan, softmax_scale=1.0)
    assert plan.state is PlanState.NEW and session.sequences["main"].pending is None
    assert cache.pool.num_free == free and cache.storage_pool.num_free == 0
    cache.storage_pool.free(taken)
    ShardedForwardCall(cache, plan, softmax_scale=1.0).commit()  # now it runs
    assert cache.storage_pool.num_held == 1


def test_project_needs_a_prepared_plan_of_this_cache():
    config = PagingConfig(block_size=4, chunk_size=4, window_chunks=2)
    geometry = dict(num_layers=1, num_kv_heads=1, head_dim=1, shard_degree=2)
    cache, other = (ShardedKVCache(config, shard_index=i, **geometry) for i in range(2))
    plan = other.plan(other.open_session(), "main", 4)
    plan.prepare()
    with pytest.raises(ValueError, match="prepared plan of this cache"):
        cache.project(plan)
    plan = cache.plan(cache.open_session(), "main", 4)  # not prepared
    with pytest.raises(ValueError, match="prepared plan of this cache"):
        cache.project(plan)


def test_a_refused_first_call_leaves_the_mean_and_factors_unchosen():
    # The op chooses a layer's K mean and equalization factors from every video token
    # (choice_slots, the single process's slots) only once every argument passed; when it
    # refuses (a query of the wrong width), the values and their flags are as before, and the
    # next call chooses them.
    config = PagingConfig(block_size=4, chunk_size=4, window_chunks=2, kv_dtype=torch.int8)
    cache = ShardedKVCache(
        config, shard_degree=2, shard_index=0, num_layers=1, num_kv_heads=1, head_dim=8
    )
    state = ("k_means", "k_equalizers", "v_equalizers", "k_means_chosen", "equalizers_chosen")
    before = [getattr(cache, name).clone() for name in state]
    plan = cache.plan(cache.open_session(), "main", 4)
    call = ShardedForwardCall(cache, plan, softmax_scale=1.0)
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 4, 1, 8, generator=gen) * torch.exp2(torch.arange(8.0))
    with pytest.raises(ValueError, match="head_dim"):
        call.attend(0, torch.randn(4, 1, 7), k, v)
    for name, then in zip(state, before, strict=True):
        assert torch.equal(getattr(cache, name), then), name
    call.attend(0, torch.randn(4, 1, 8), k, v)
    assert cache.k_means_chosen.all() and cache.equalizers_chosen.all()
    assert (cache.k_equalizers > 1).any() and cache.k_means.abs().sum() > 0


def test_a_sharded_cache_refuses_forks_and_pool_blocks():
    config = PagingConfig(block_size=4, chunk_size=8, sink_chunks=1, window_chunks=2)
    geometry = dict(shard_degree=2, shard_index=0, num_layers=1, num_kv_heads=1, head_dim=2)
    with pytest.raises(ValueError, match="pool_blocks"):
        ShardedKVCache(config, pool_blocks=64, **geometry)
    cache = ShardedKVCache(config, session_capacity=2, **geometry)
    session = cache.open_session()
    free = cache.pool.num_free
    with pytest.raises(ValueError, match="does not fork"):
        cache.fork(session)
    assert cache.pool.num_free == free and len(cache.sessions) == 1
