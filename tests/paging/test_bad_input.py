"""Bad input (DESIGN section 7): a clear TypeError/ValueError naming the argument, and a cache
left exactly as it was (free count, tables, committed tokens)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paged_video.paging import PagedKVCache, PagingConfig, PoolExhaustedError, batch_plans
from tests.paging.rollout import snapshot

CONFIG = PagingConfig(
    block_size=4, chunk_size=6, sink_chunks=1, window_chunks=2, max_action_tokens=2
)


@pytest.fixture
def cache() -> PagedKVCache:
    cache = PagedKVCache(
        CONFIG,
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        branches=("pos", "neg"),
        session_capacity=2,
    )
    session = cache.open_session()
    plan = cache.plan(session, "pos", 6, commit=True)
    plan.prepare()
    plan.commit()
    return cache


def the_session(cache: PagedKVCache):
    return next(iter(cache.sessions.values()))


def raises_unchanged(cache: PagedKVCache, error: type[Exception], match: str, call) -> None:
    before = snapshot(cache)
    with pytest.raises(error, match=match):
        call()
    assert snapshot(cache) == before


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(branch="zero"), ValueError, "branch"),  # unknown branch
        (dict(branch=0), TypeError, "branch"),
        (dict(num_tokens=4), ValueError, "num_tokens"),  # not a whole number of chunks
        (dict(num_tokens=12), ValueError, "num_tokens"),  # longer than max_forward_tokens
        (dict(num_tokens=0), ValueError, "num_tokens"),
        (dict(num_tokens=6.0), TypeError, "num_tokens"),
        (dict(commit=1), TypeError, "commit"),
        (dict(action_tokens=3), ValueError, "action_tokens"),
        (dict(action_tokens=-1), ValueError, "action_tokens"),
    ],
)
def test_bad_plan_arguments(cache: PagedKVCache, kwargs: dict, error, match: str) -> None:
    args = dict(branch="pos", num_tokens=6) | kwargs
    branch, num_tokens = args.pop("branch"), args.pop("num_tokens")
    session = the_session(cache)
    raises_unchanged(cache, error, match, lambda: cache.plan(session, branch, num_tokens, **args))


def test_pending_committing_forward_cannot_be_replaced(cache: PagedKVCache) -> None:
    session = the_session(cache)
    cache.plan(session, "pos", 6, commit=True).prepare()
    replacement = cache.plan(session, "pos", 6, commit=True)
    raises_unchanged(cache, ValueError, "pending", replacement.prepare)
    scratch = cache.plan(session, "pos", 6)  # would overwrite the pending forward's tail
    raises_unchanged(cache, ValueError, "pending", scratch.prepare)
    cache.plan(session, "neg", 6).prepare()  # the other branch is another sequence


def test_exhausted_pool_fails_prepare_and_changes_nothing(cache: PagedKVCache) -> None:
    cache.pool.allocate(cache.pool.num_free)  # as if the pool were sized too small
    plan = cache.plan(the_session(cache), "pos", 6, commit=True)
    raises_unchanged(cache, PoolExhaustedError, "count=", plan.prepare)
    assert plan.inputs is None and the_session(cache).sequences["pos"].pending is None


def test_too_many_sessions(cache: PagedKVCache) -> None:
    cache.open_session()
    raises_unchanged(cache, ValueError, "session_capacity=2", cache.open_session)


def test_closed_foreign_or_wrong_sessions(cache: PagedKVCache) -> None:
    session = the_session(cache)
    plan = cache.plan(session, "pos", 6, commit=True)
    committing = cache.plan(session, "neg", 6, commit=True)
    committing.prepare()
    cache.close_session(session)
    raises_unchanged(cache, ValueError, "not open", plan.prepare)
    raises_unchanged(cache, ValueError, "not open", committing.commit)
    # Prepared before the close: its blocks went back to the pool, its scratch lane too.
    raises_unchanged(cache, ValueError, "not open", committing.prepare)
    raises_unchanged(cache, ValueError, "not open", lambda: cache.plan(session, "pos", 6))
    raises_unchanged(cache, ValueError, "not open", lambda: cache.close_session(session))
    other = PagedKVCache(CONFIG, num_layers=1, num_kv_heads=1, head_dim=2)
    foreign = other.open_session()
    raises_unchanged(cache, ValueError, "not open", lambda: cache.plan(foreign, "pos", 6))
    raises_unchanged(cache, TypeError, "session", lambda: cache.plan("s0", "pos", 6))


def test_cancelled_and_committed_plans(cache: PagedKVCache) -> None:
    session = the_session(cache)
    cancelled = cache.plan(session, "pos", 6)
    cancelled.cancel()
    raises_unchanged(cache, ValueError, "cancelled", cancelled.prepare)
    done = cache.plan(session, "pos", 6, commit=True)
    done.prepare()
    done.commit()
    raises_unchanged(cache, ValueError, "committed", done.cancel)


def test_bad_batches(cache: PagedKVCache) -> None:
    session = the_session(cache)
    prepared = cache.plan(session, "pos", 6)
    prepared.prepare()
    twin = cache.plan(session, "pos", 6)
    twin.prepare()
    other = PagedKVCache(CONFIG, num_layers=1, num_kv_heads=1, head_dim=2)
    stranger = other.plan(other.open_session(), "main", 6)
    stranger.prepare()
    for plans, error, match in [
        ([], TypeError, "plans"),
        (prepared, TypeError, "plans"),
        ([prepared, "plan"], TypeError, r"plans\[1\]"),
        ([cache.plan(session, "neg", 6)], ValueError, r"plans\[0\] is not prepared"),
        ([prepared, twin], ValueError, "twice"),
        ([prepared, stranger], ValueError, "another cache"),
    ]:
        raises_unchanged(cache, error, match, lambda plans=plans: batch_plans(plans))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(config={"block_size": 4}), TypeError, "^config must be a PagingConfig, got dict$"),
        (dict(num_layers=0), ValueError, "num_layers"),
        (dict(num_kv_heads=0), ValueError, "num_kv_heads"),
        (dict(head_dim=2.0), TypeError, "head_dim"),
        (dict(session_capacity=0), ValueError, "session_capacity"),
        (dict(branches="pos"), TypeError, "branches"),
        (dict(branches=()), ValueError, "branches"),
        (dict(branches=("a", "a")), ValueError, "branches"),
        (dict(dtype=torch.int32), TypeError, "dtype"),
    ],
)
def test_bad_cache_arguments(kwargs: dict, error, match: str) -> None:
    args = dict(config=CONFIG, num_layers=1, num_kv_heads=1, head_dim=2) | kwargs
    config = args.pop("config")
    with pytest.raises(error, match=match):
        PagedKVCache(config, **args)


@pytest.mark.parametrize(("index", "error"), [(1, ValueError), (-1, ValueError), ("0", TypeError)])
def test_bad_layer_index(cache: PagedKVCache, index, error) -> None:
    raises_unchanged(cache, error, "index", lambda: cache.layer(index))


def test_bad_config_changes_no_cache(cache: PagedKVCache) -> None:
    raises_unchanged(
        cache,
        ValueError,
        r"^window_chunks must be in 1\.\.65536, got 0$",
        lambda: dataclasses.replace(CONFIG, window_chunks=0),
    )
