"""Every public entry point that refuses its input leaves the cache exactly as it found it
(docs/errors.md): free count, tables, committed tokens, pending forwards, and every byte of
the pools, the staging buffers and the staging record, and for quantized caches of the scales,
the K means and their flags. One table of refusals over a cache with history, a fork sharing
it, a staged forward, a pending committing forward, a cancelled and a stale plan, with float
and quantized pools.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from paged_video import kernels
from paged_video.kernels.fused import write_attend
from paged_video.paging import ForwardPlan, PagedKVCache, PagingConfig, Session, batch_plans
from paged_video.paging.forward import ForwardCall
from tests.paging.rollout import snapshot
from tests.paging.twin import plain_torch_kernels

CONFIG = PagingConfig(
    block_size=4,
    chunk_size=8,
    sink_chunks=1,
    window_chunks=2,
    max_action_tokens=3,
    reuse_history_staging=True,
)
N = CONFIG.chunk_size


@dataclass
class World:
    cache: PagedKVCache
    session: Session
    pending: ForwardPlan  # a committing forward on "neg", prepared, not run
    cancelled: ForwardPlan  # a committing plan on "pos", prepared then cancelled
    stale: ForwardPlan  # a scratch plan on "pos", prepared before the last commit
    stale_call: ForwardCall
    behind_pending: ForwardPlan  # a scratch plan on "neg", prepared before the pending one
    committed: ForwardPlan  # the last committing plan on "pos", run and committed
    other: Session  # a fork of session's history, taking the last session slot
    closed: Session  # a session that was closed


def tensors(
    *, video: int = N, actions: int = 2, heads: int = 2, kv_heads: int = 1, dim: int = 4, seed=5
):
    """query, key, value, action_key, action_value for one row (a refused call is given other
    values than the world's forwards wrote, so a write it should not make shows)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(video, heads, dim, generator=gen),
        torch.randn(video, kv_heads, dim, generator=gen),
        torch.randn(video, kv_heads, dim, generator=gen),
        torch.randn(actions, kv_heads, dim, generator=gen),
        torch.randn(actions, kv_heads, dim, generator=gen),
    ]


def run(cache: PagedKVCache, plan: ForwardPlan) -> ForwardCall:
    call = ForwardCall(cache, plan, softmax_scale=0.5)
    for layer in range(cache.num_layers):
        call.attend(layer, *tensors(actions=plan.action_tokens))
    return call


@pytest.fixture(params=[None, torch.int8], ids=["float", "int8"])
def world(request: pytest.FixtureRequest) -> World:
    cache = PagedKVCache(
        dataclasses.replace(CONFIG, kv_dtype=request.param),
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        branches=("pos", "neg"),
        session_capacity=2,
        dtype=torch.float32,
    )
    gen = torch.Generator().manual_seed(0)
    for buffer in cache.pool_tensors[:8]:  # pools, staging buffers and their scales
        if buffer.dtype == torch.float32:
            buffer.copy_(torch.randn(buffer.shape, generator=gen))
        else:
            buffer.view(torch.int8).copy_(torch.randint(-100, 100, buffer.shape, generator=gen))
    session = cache.open_session()
    closed = cache.open_session()
    cache.close_session(closed)
    with plain_torch_kernels():
        for _ in range(2):
            run(cache, cache.plan(session, "pos", N, commit=True)).commit()
        other = cache.fork(session)  # every session slot taken
        cancelled = cache.plan(session, "pos", N, commit=True)
        cancelled.prepare()
        cancelled.cancel()
        stale = cache.plan(session, "pos", N)
        stale_call = ForwardCall(cache, stale, softmax_scale=0.5)
        last = run(cache, cache.plan(session, "pos", N, commit=True))
        last.commit()
        run(cache, cache.plan(session, "pos", N))  # staged: the record holds its history
    assert (cache.stage_tags >= 0).all()
    if cache.quantized:
        # Means (and int8's equalization factors) chosen. Unchoosing them again would leave
        # committed tokens under no chosen state, which every forward refuses
        # (PagedKVCache.check_layer_state); that a refused call chooses nothing is held where no
        # token is committed: tests/kernels/test_fused_quantized.py and tests/paging/test_shard.py.
        assert cache.k_means_chosen.all() and cache.equalizers_chosen.all()
    behind_pending = cache.plan(session, "neg", N)
    behind_pending.prepare()
    pending = cache.plan(session, "neg", N, commit=True)
    pending.prepare()
    return World(
        cache,
        session,
        pending,
        cancelled,
        stale,
        stale_call,
        behind_pending,
        last.plans[0],
        other,
        closed,
    )


def full_snapshot(cache: PagedKVCache) -> tuple:
    """``snapshot`` plus the bytes of the pools, staging buffers and the staging record."""
    buffers = (*cache.pool_tensors, cache.stage_tags)
    return snapshot(cache), [buffer.clone().view(torch.uint8) for buffer in buffers]


def same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def attend(w: World, *, index: int = 0, actions: int = 2, **changes) -> None:
    """A scratch forward of "pos" with ``actions`` action tokens, attending with ``changes``."""
    call = ForwardCall(
        w.cache, w.cache.plan(w.session, "pos", N, action_tokens=actions), softmax_scale=0.5
    )
    names = ("query", "key", "value", "action_key", "action_value")
    args = dict(zip(names, tensors(actions=actions, seed=6), strict=True)) | changes
    call.attend(index, **args)


def op(w: World, *, layer: int = 0, pools: dict | None = None, **changes) -> None:
    """The fused op called directly with a scratch forward's inputs and ``changes`` (and
    ``pools`` replacing some of the cache's tensors)."""
    call = ForwardCall(w.cache, w.cache.plan(w.session, "pos", N), softmax_scale=0.5)
    inputs = call.layer(0)._replace(layer=torch.tensor(layer), **changes)
    write_attend(
        *tensors(actions=0, seed=6), w.cache.pool_tensors._replace(**(pools or {})), inputs
    )


def foreign_plan() -> ForwardPlan:
    other = PagedKVCache(CONFIG, num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    return other.plan(other.open_session(), "main", N)


def flat(w: World):
    layer = w.cache.layer(0)
    return layer.k_flat, layer.v_flat


def scales(w: World, *, flat: bool = False, stage: bool = False) -> dict:
    """Layer 0's scales as the kernels' keyword arguments (none for float pools)."""
    c = w.cache
    if not c.quantized:
        return {}
    k, v = (s[0].flatten(0, 1) if flat else s[0] for s in (c.k_scales, c.v_scales))
    given = {"k_scale": k, "v_scale": v}
    if stage:
        given |= {"stage_k_scale": c.stage_k_scales[0], "stage_v_scale": c.stage_v_scales[0]}
    return given


REFUSALS = [
    # PagedKVCache and plans
    ("plan-branch", lambda w: w.cache.plan(w.session, "zero", N), ValueError, "branch"),
    ("plan-tokens", lambda w: w.cache.plan(w.session, "pos", 5), ValueError, "num_tokens"),
    ("plan-commit", lambda w: w.cache.plan(w.session, "pos", N, commit=1), TypeError, "commit"),
    (
        "plan-actions",
        lambda w: w.cache.plan(w.session, "pos", N, action_tokens=4),
        ValueError,
        "action_tokens",
    ),
    ("open-session", lambda w: w.cache.open_session(), ValueError, "session_capacity"),
    ("fork-mid-forward", lambda w: w.cache.fork(w.session), ValueError, "mid-forward"),
    ("fork-capacity", lambda w: w.cache.fork(w.other), ValueError, "session_capacity"),
    ("fork-closed", lambda w: w.cache.fork(w.closed), ValueError, "not open"),
    ("fork-not-a-session", lambda w: w.cache.fork("s"), TypeError, "session"),
    ("fork-foreign", lambda w: w.cache.fork(foreign_plan().session), ValueError, "not open"),
    ("close-foreign", lambda w: w.cache.close_session("s"), TypeError, "session"),
    ("layer-index", lambda w: w.cache.layer(2), ValueError, "index"),
    (
        "prepare-pending",
        lambda w: w.cache.plan(w.session, "neg", N).prepare(),
        ValueError,
        "pending",
    ),
    ("prepare-cancelled", lambda w: w.cancelled.prepare(), ValueError, "cancelled"),
    ("prepare-committed", lambda w: w.committed.prepare(), ValueError, "plan is committed"),
    (
        "prepare-overtaken",
        lambda w: w.stale.prepare(),
        ValueError,
        r"^plan is stale: overtaken by 1 commit\(s\) on branch 'pos' of session 0 .* -> 24 ",
    ),
    ("prepare-behind-pending", lambda w: w.behind_pending.prepare(), ValueError, "pending"),
    ("batch-empty", lambda w: batch_plans([]), TypeError, "plans"),
    ("batch-twice", lambda w: batch_plans([w.pending, w.pending]), ValueError, "twice"),
    ("batch-overtaken", lambda w: batch_plans([w.stale]), ValueError, r"plans\[0\] is stale"),
    ("batch-cancelled", lambda w: batch_plans([w.cancelled]), ValueError, "cancelled"),
    (
        "batch-behind-pending",
        lambda w: batch_plans([w.pending, w.behind_pending]),
        ValueError,
        r"plans\[1\]: a committing forward is pending",
    ),
    # ForwardCall
    (
        "call-softmax-str",
        lambda w: ForwardCall(w.cache, w.cache.plan(w.session, "pos", N), softmax_scale="0.1"),
        TypeError,
        "softmax_scale",
    ),
    (
        "call-cancelled",
        lambda w: ForwardCall(w.cache, w.cancelled, softmax_scale=0.5),
        ValueError,
        "cancelled",
    ),
    (
        "call-stale",
        lambda w: ForwardCall(w.cache, w.stale, softmax_scale=0.5),
        ValueError,
        r"plans\[0\] is stale: overtaken",
    ),
    (
        "call-behind-pending",
        lambda w: ForwardCall(w.cache, w.behind_pending, softmax_scale=0.5),
        ValueError,
        r"plans\[0\]: a committing forward is pending",
    ),
    (
        "call-scratch-then-committing",
        lambda w: ForwardCall(
            w.cache,
            [w.cache.plan(w.session, "pos", N), w.cache.plan(w.session, "pos", N, commit=True)],
            softmax_scale=0.5,
        ),
        ValueError,
        r"plans\[0\]: a committing forward is pending",
    ),
    (
        "call-softmax-nan",
        lambda w: ForwardCall(
            w.cache, w.cache.plan(w.session, "pos", N), softmax_scale=float("nan")
        ),
        ValueError,
        "softmax_scale must be finite",
    ),
    (
        "call-pending",
        lambda w: ForwardCall(w.cache, w.cache.plan(w.session, "neg", N), softmax_scale=0.5),
        ValueError,
        "pending",
    ),
    (
        "call-two-committing",
        lambda w: ForwardCall(
            w.cache,
            [
                w.cache.plan(w.session, "pos", N, commit=True),
                w.cache.plan(w.session, "pos", N, commit=True),
            ],
            softmax_scale=0.5,
        ),
        ValueError,
        "pending",
    ),
    (
        "call-same-row-twice",
        lambda w: ForwardCall(
            w.cache,
            [w.cache.plan(w.session, "pos", N, commit=True), w.cache.plan(w.session, "pos", N)],
            softmax_scale=0.5,
        ),
        ValueError,
        "pending",
    ),
    (
        "call-other-cache",
        lambda w: ForwardCall(w.cache, foreign_plan(), softmax_scale=0.5),
        ValueError,
        "another cache",
    ),
    (
        "call-cache-type",
        lambda w: ForwardCall("cache", w.cache.plan(w.session, "pos", N), softmax_scale=0.5),
        TypeError,
        "cache must be a PagedKVCache",
    ),
    (
        "call-plan-type",
        lambda w: ForwardCall(
            w.cache, [w.cache.plan(w.session, "pos", N), "plan"], softmax_scale=0.5
        ),
        TypeError,
        r"plans\[1\] must be a ForwardPlan",
    ),
    ("call-no-plans", lambda w: ForwardCall(w.cache, [], softmax_scale=0.5), TypeError, "plans"),
    (  # refused by prepare; undoing it must not drop the other plan's pending blocks
        "call-committing-behind-pending",
        lambda w: ForwardCall(
            w.cache, w.cache.plan(w.session, "neg", N, commit=True), softmax_scale=0.5
        ),
        ValueError,
        "pending",
    ),
    (
        "call-not-plans",
        lambda w: ForwardCall(w.cache, "plan", softmax_scale=0.5),
        TypeError,
        "plans",
    ),
    (
        "call-stale-attend",
        lambda w: w.stale_call.attend(0, *tensors(actions=0)),
        ValueError,
        "stale",
    ),
    ("call-stale-layer", lambda w: w.stale_call.layer(0), ValueError, "stale"),
    # ForwardCall.attend: every argument checked before the first write
    (
        "attend-layer-past-last",
        lambda w: attend(w, index=2),
        ValueError,
        r"index \(the layer\) must be in 0\.\.1 \(num_layers=2\), got 2",
    ),
    (
        "attend-layer-negative",
        lambda w: attend(w, index=-1),
        ValueError,
        r"index \(the layer\) must be in 0\.\.1",
    ),
    ("attend-layer-type", lambda w: attend(w, index=torch.tensor(0)), TypeError, "index"),
    (
        "attend-action-heads",
        lambda w: attend(w, action_key=torch.zeros(2, 2, 4), action_value=torch.zeros(2, 2, 4)),
        ValueError,
        "action_key",
    ),
    (
        "attend-action-value-heads",
        lambda w: attend(w, action_value=torch.zeros(2, 2, 4)),
        ValueError,
        "action_value",
    ),
    (
        "attend-action-rows",
        lambda w: attend(w, action_key=torch.zeros(1, 1, 4), action_value=torch.zeros(1, 1, 4)),
        ValueError,
        "action_key",
    ),
    (
        "attend-action-missing",
        lambda w: attend(w, action_value=None),
        ValueError,
        "action_key and action_value",
    ),
    (
        "attend-actions-omitted",
        lambda w: attend(w, action_key=None, action_value=None),
        ValueError,
        "action_key",
    ),
    ("attend-key-rows", lambda w: attend(w, key=torch.zeros(N - 1, 1, 4)), ValueError, "key"),
    ("attend-key-type", lambda w: attend(w, key=[0.0]), TypeError, "key"),
    (
        "attend-key-float-no-actions",
        lambda w: attend(w, actions=0, key=0.5, action_key=None, action_value=None),
        TypeError,
        "key must be a torch.Tensor",
    ),
    (
        "attend-value-float-no-actions",
        lambda w: attend(w, actions=0, value=0.5, action_key=None, action_value=None),
        TypeError,
        "value must be a torch.Tensor",
    ),
    (  # refused before the video is written, not by the action write after it
        "attend-action-value-dtype",
        lambda w: attend(w, action_value=torch.zeros(2, 1, 4, dtype=torch.float64)),
        TypeError,
        "action_value",
    ),
    (
        "attend-action-value-rows",
        lambda w: attend(w, action_value=torch.zeros(1, 1, 4)),
        ValueError,
        "action_value shape",
    ),
    (
        "attend-value-dtype",
        lambda w: attend(w, value=torch.zeros(N, 1, 4, dtype=torch.float64)),
        TypeError,
        "value",
    ),
    ("attend-value-shape", lambda w: attend(w, value=torch.zeros(N, 1, 5)), ValueError, "value"),
    ("attend-query-rank", lambda w: attend(w, query=torch.zeros(N, 8)), ValueError, "query"),
    ("attend-query-rows", lambda w: attend(w, query=torch.zeros(N + 1, 2, 4)), ValueError, "query"),
    (
        "attend-query-dtype",
        # float32 pools take float32 queries; quantized pools any float query but float64
        lambda w: attend(
            w, query=torch.zeros(N, 2, 4, dtype=torch.float64 if w.cache.quantized else torch.half)
        ),
        TypeError,
        "query",
    ),
    (
        "attend-query-device",
        lambda w: attend(w, query=torch.zeros(N, 2, 4, device="meta")),
        ValueError,
        "device",
    ),
    # the fused op called directly
    ("op-layer", lambda w: op(w, layer=2), ValueError, "layer"),
    ("op-layer-shape", lambda w: op(w, layer=[0, 1]), ValueError, "layer"),
    (
        "op-stage-tags",
        lambda w: op(w, stage_tags=torch.zeros(3, dtype=torch.int64)),
        ValueError,
        "stage_tags",
    ),
    ("op-stage-from", lambda w: op(w, stage_from=torch.tensor(99)), ValueError, "stage_from"),
    (
        "op-video-slots-rows",
        lambda w: op(w, video_slots=torch.arange(N - 1) + 4),
        ValueError,
        r"key must have one row per entry of video_slots \(7\)",
    ),
    ("op-softmax-scale", lambda w: op(w, softmax_scale=float("nan")), ValueError, "softmax_scale"),
    (
        "op-block-table-dtype",
        lambda w: op(w, block_table=torch.zeros(1, 9, dtype=torch.int64)),
        TypeError,
        "block_table",
    ),
    (
        "op-two-rows-staged",
        lambda w: op(w, block_table=torch.zeros(2, 9, dtype=torch.int32)),
        ValueError,
        "cu_seqlens_q",
    ),
    # the cache tensors of quantized pools (float pools: zero-size ones)
    ("op-k-scales", lambda w: op(w, pools={"k_scales": torch.zeros(3)}), ValueError, "k_scales"),
    ("op-k-means", lambda w: op(w, pools={"k_means": torch.zeros(2, 1, 5)}), ValueError, "k_means"),
    (
        "op-k-means-chosen",
        lambda w: op(w, pools={"k_means_chosen": torch.zeros(3, dtype=torch.bool)}),
        ValueError,
        "k_means_chosen",
    ),
    (
        "op-stage-v-scales",
        lambda w: op(w, pools={"stage_v_scales": torch.zeros(1)}),
        ValueError,
        "stage_v_scales",
    ),
    ("op-fp8-mma-deleted", lambda w: op(w, fp8_mma=True), ValueError, "fp8_mma was deleted"),
    (
        "op-stage-key-shape",
        lambda w: op(w, stage_key=torch.tensor([1, 2])),
        ValueError,
        "stage_key",
    ),
    (
        "op-stage-tags-rank",
        lambda w: op(w, stage_tags=torch.zeros(2, 1, dtype=torch.int64)),
        ValueError,
        "stage_tags must have rank 1",
    ),
    (
        "op-video-slots-rank",
        lambda w: op(w, video_slots=(torch.arange(N) + 4).view(N, 1)),
        ValueError,
        "video_slots must have rank 1",
    ),
    (
        "op-stage-tags-dtype",
        lambda w: op(w, stage_tags=torch.zeros(2, dtype=torch.int32)),
        TypeError,
        "stage_tags must have dtype int64",
    ),
    (
        "op-action-slots-dtype",
        lambda w: op(w, action_slots=torch.zeros(0)),
        TypeError,
        "action_slots must have dtype",
    ),
    (
        "op-k-pools-rank",
        lambda w: op(w, pools={"k_pools": w.cache.k_pools[0], "v_pools": w.cache.v_pools[0]}),
        ValueError,
        "k_pools must have rank 5",
    ),
    (
        "op-v-pools-shape",
        lambda w: op(w, pools={"v_pools": w.cache.v_pools[:, :-1]}),
        ValueError,
        "v_pools shape",
    ),
    (
        "op-one-tensor-for-both-pools",
        lambda w: op(w, pools={"v_pools": w.cache.k_pools}),
        ValueError,
        "separate tensors",
    ),
    (
        "op-stage-k-rank",
        lambda w: op(w, pools={"stage_k": w.cache.stage_k[0], "stage_v": w.cache.stage_v[0]}),
        ValueError,
        "stage_k must have rank 4",
    ),
    (
        "op-stage-v-shape",
        lambda w: op(w, pools={"stage_v": w.cache.stage_v[:, :-1]}),
        ValueError,
        "stage_v shape",
    ),
    (
        "op-stage-k-layers",
        lambda w: op(w, pools={"stage_k": w.cache.stage_k[:1], "stage_v": w.cache.stage_v[:1]}),
        ValueError,
        "stage_k must have shape",
    ),
    (
        "op-pool-not-tensor",
        lambda w: op(w, pools={"k_scales": [0.0]}),
        TypeError,
        "k_scales must be a torch.Tensor",
    ),
    (
        "op-pools-not-pool-tensors",
        lambda w: write_attend(
            *tensors(actions=0),
            tuple(w.cache.pool_tensors),
            ForwardCall(w.cache, w.cache.plan(w.session, "pos", N), softmax_scale=0.5).layer(0),
        ),
        TypeError,
        "pools must be a PoolTensors",
    ),
    # the kernels on the cache's own pools
    (
        "write-slots-past-pool",
        lambda w: kernels.write_slots(
            torch.zeros(2, 1, 4),
            torch.zeros(2, 1, 4),
            *flat(w),
            torch.tensor([0, 10**6]),
            **scales(w, flat=True),
        ),
        ValueError,
        "slot_mapping",
    ),
    (
        "gather-bad-id",
        lambda w: kernels.gather_blocks(
            w.cache.k_pools[0],
            w.cache.v_pools[0],
            torch.tensor([1, 10**6]),
            w.cache.stage_k[0],
            w.cache.stage_v[0],
            **scales(w, stage=True),
        ),
        ValueError,
        "block_ids",
    ),
    (
        "attention-softmax-str",
        lambda w: kernels.paged_attention(
            torch.zeros(N, 2, 4),
            w.cache.k_pools[0],
            w.cache.v_pools[0],
            torch.ones(1, 2, dtype=torch.int32),
            torch.tensor([0, N], dtype=torch.int32),
            torch.tensor([8], dtype=torch.int32),
            max_seqlen_q=N,
            softmax_scale="0.1",
            **scales(w),
        ),
        TypeError,
        "softmax_scale",
    ),
]


@pytest.mark.parametrize("call, error, match", [pytest.param(*r[1:], id=r[0]) for r in REFUSALS])
def test_refused_call_changes_nothing(world: World, call, error, match: str) -> None:
    before = full_snapshot(world.cache)
    with pytest.raises(error, match=match):
        call(world)
    assert same(full_snapshot(world.cache), before)


def test_cancel_of_a_committed_plan_changes_nothing(world: World) -> None:
    with plain_torch_kernels():
        call = run(world.cache, world.cache.plan(world.session, "pos", N, commit=True))
    call.commit()
    before = full_snapshot(world.cache)
    with pytest.raises(ValueError, match="committed"):
        call.plans[0].cancel()
    assert same(full_snapshot(world.cache), before)


def test_prepared_cancelled_plan_refuses_prepare_and_its_blocks_stay_free(world: World) -> None:
    # Issue 9: prepare() after cancel() returned the first tensors, whose blocks had gone back
    # to the pool; the next committing forward got one of them and both wrote into it.
    cache, session = world.cache, world.session
    first = cache.plan(session, "pos", N, commit=True)
    blocks = set(first.prepare().video_slots.div(4, rounding_mode="floor").tolist())
    first.cancel()
    with pytest.raises(ValueError, match="cancelled"):
        first.prepare()
    assert first.state.value == "cancelled"
    second = cache.plan(session, "pos", N, commit=True)
    second.prepare()
    with pytest.raises(ValueError, match="cancelled"):
        ForwardCall(cache, first, softmax_scale=0.5)
    held = set(session.sequences["pos"].block_table)
    assert blocks <= held  # handed out again, to the live plan only


def test_device_without_gpu_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="device 'cuda' is not usable"):
        PagedKVCache(CONFIG, num_layers=1, num_kv_heads=1, head_dim=4, device="cuda")
    with pytest.raises(ValueError, match="device 'cudaa' is not usable"):
        PagedKVCache(CONFIG, num_layers=1, num_kv_heads=1, head_dim=4, device="cudaa")
    with pytest.raises(TypeError, match="device"):
        PagedKVCache(CONFIG, num_layers=1, num_kv_heads=1, head_dim=4, device=0)


def test_pools_too_large_to_allocate_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cannot allocate the pools"):
        PagedKVCache(CONFIG, num_layers=2**40, num_kv_heads=1, head_dim=4)


def test_a_plan_overtaken_by_an_evicting_commit_refuses_every_hand_out() -> None:
    # A scratch plan prepared, then a commit that evicts: the plan's table lists blocks that
    # went back to the pool. prepare() returned them before (a driver of its own read freed,
    # reusable blocks); now it refuses in one line, as batching and ForwardCall do.
    cache = PagedKVCache(CONFIG, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    session = cache.open_session()
    for _ in range(3):
        plan = cache.plan(session, "main", N, commit=True)
        plan.prepare()
        plan.commit()
    overtaken = cache.plan(session, "main", N)
    table = overtaken.prepare().block_table[0].tolist()
    plan = cache.plan(session, "main", N, commit=True)
    plan.prepare()
    assert plan.commit() and session.sequences["main"].compacted > 0  # evicted, compacted
    assert any(block and not cache.pool.is_held(block) for block in table)
    before = full_snapshot(cache)
    for hand_out in (
        overtaken.prepare,
        lambda: batch_plans([overtaken]),
        lambda: ForwardCall(cache, overtaken, softmax_scale=0.5),
    ):
        with pytest.raises(ValueError, match="stale: overtaken by 1 commit") as error:
            hand_out()
        assert "\n" not in str(error.value) and "session 0" in str(error.value)
    assert same(full_snapshot(cache), before)
    assert overtaken.state.value == "prepared"  # refused, not changed: cancel() still works
    overtaken.cancel()
