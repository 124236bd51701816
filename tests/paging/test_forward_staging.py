"""History staging through ``ForwardCall``: staged and unstaged caches agree bit for bit after
batched forwards, dropped, cancelled and abandoned plans, and the reuse still happens.

The short scenarios run the Triton kernels; the longer sequences take the plain-PyTorch path
(``plain``), since what they test is the staging record, not the kernels. The kernels' own
agreement (the staged window attended with the paged call's launch: same tile, key order and
float32 sums) is checked on random geometries and pool formats through the kernels.
"""

from __future__ import annotations

import dataclasses
import importlib
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from paged_video.kernels import fused
from paged_video.kernels.gather_blocks import gather_blocks
from paged_video.paging import PagedKVCache, PagingConfig
from paged_video.paging.forward import ForwardCall
from tests.paging.twin import Twin, plain_torch_kernels

# C = 2B: every chunk starts and ends on block edges, so single-row forwards may reuse staging.
ALIGNED = PagingConfig(block_size=4, chunk_size=8, sink_chunks=1, window_chunks=3)
BOTH = [(0, "positive"), (0, "negative")]


@pytest.fixture
def plain():
    with plain_torch_kernels():
        yield


def twin(**kwargs) -> Twin:
    result = Twin(ALIGNED, branches=("positive", "negative"), **kwargs)
    result.open()
    return result


def test_single_row_after_batched_forwards_matches_unstaged() -> None:
    # The scenario: two committing ticks and a scratch forward, each one ForwardCall
    # over both branches (batched: nothing is staged), then a scratch single-row forward.
    pair = twin()
    pair.forward(BOTH, commit=True)
    pair.forward(BOTH, commit=True)
    pair.forward(BOTH, commit=False)
    pair.forward(BOTH[1:], commit=False)  # the row the batch prepared last
    pair.forward(BOTH[:1], commit=False)


def test_prepared_then_dropped_plan_stages_nothing() -> None:
    # The staging buffers hold the negative branch when the positive one's plan is dropped.
    pair = twin()
    pair.forward(BOTH[:1], commit=True)
    pair.forward(BOTH[1:], commit=True)
    for plan in pair.plans(BOTH[:1], commit=False)[0]:
        plan.prepare()  # dropped: never run, never cancelled
    pair.forward(BOTH[:1], commit=False)


def test_dropped_forward_call_stages_nothing() -> None:
    pair = twin()
    pair.forward(BOTH[:1], commit=True)
    pair.forward(BOTH[1:], commit=True)
    ForwardCall(pair.staged, pair.plans(BOTH[:1], commit=False)[0], softmax_scale=0.5)
    pair.forward(BOTH[:1], commit=False)


@pytest.mark.usefixtures("plain")
def test_cancelled_plans_stage_nothing() -> None:
    pair = twin()
    pair.forward(BOTH[:1], commit=True)
    for commit in (False, True):
        pair.forward(BOTH[1:], commit=False)
        staged, _ = pair.plans(BOTH[:1], commit=commit)
        staged[0].prepare()
        staged[0].cancel()
        pair.forward(BOTH[:1], commit=False)


@pytest.mark.usefixtures("plain")
def test_forward_abandoned_after_one_layer() -> None:
    # Layer 0 restages the positive branch, layer 1 never runs and still holds the negative
    # branch: the next forward of that history may keep layer 0's staging only.
    pair = twin(num_layers=3)
    pair.forward(BOTH[:1], commit=True)
    pair.forward(BOTH[1:], commit=False)
    pair.run(pair.plans(BOTH[:1], commit=False), layers=range(1))
    pair.forward(BOTH[:1], commit=False)
    pair.run(pair.plans(BOTH[:1], commit=False), layers=range(2, -1, -1))


@pytest.mark.usefixtures("plain")
def test_interleaved_sessions_branches_and_batches() -> None:
    pair = Twin(ALIGNED, branches=("positive", "negative"), session_capacity=2)
    pair.open()
    pair.open()
    rows = [(s, b) for s in (0, 1) for b in ("positive", "negative")]
    pair.forward(rows, commit=True)
    for tick in range(4):
        pair.forward(rows[tick : tick + 1], commit=False)
        pair.forward(rows, commit=False)
        pair.forward(rows[3:], commit=False)  # the row the batch prepared last
        pair.forward(rows[tick : tick + 1], commit=tick % 2 == 0)


def test_repeated_probe_restages_only_its_chunk() -> None:
    # The reuse is kept: the second identical probe leaves the history rows alone (poisoned
    # here after the first probe, so they stay NaN).
    pair = twin()
    cache = pair.staged
    for _ in range(2):
        pair.forward(BOTH[:1], commit=True)  # history 16: 4 sink + recent blocks
    pair.forward(BOTH[:1], commit=False)
    cache.stage_k[:, : 4 * 4].fill_(float("nan"))
    call = ForwardCall(cache, pair.plans(BOTH[:1], commit=False)[0], softmax_scale=0.5)
    assert call.stage_from == 4
    for layer in range(cache.num_layers):
        q, k = torch.randn(8, 2, 4), torch.randn(8, 1, 4)
        call.attend(layer, q, k, k)
    assert torch.isnan(cache.stage_k[:, :16]).all()
    assert not torch.isnan(cache.stage_k[:, 16:24]).any()


@pytest.mark.usefixtures("plain")
def test_stage_from_says_where_the_layers_restaged_from() -> None:
    # The positive history is staged, then the negative branch restages over it: a positive
    # forward of that history may keep blocks (the op's stage_from, its first chunk block) but
    # every layer restages from block 0, and call.stage_from and plan.stage_from both say so.
    pair = twin()
    cache = pair.staged
    for branch in (BOTH[:1], BOTH[:1], BOTH[1:]):
        pair.forward(branch, commit=True)
    pair.forward(BOTH[:1], commit=False)  # the positive history, staged
    (kept,) = pair.plans(BOTH[:1], commit=False)[0]
    kept.prepare()
    assert kept.stage_from == kept.staging.first_block == 4  # sink 2 + history 2 blocks
    pair.forward(BOTH[1:], commit=False)  # the negative one over it
    call = ForwardCall(cache, kept, softmax_scale=0.5)
    assert call.stage_from == 0  # as the buffers stand now
    cache.stage_k.fill_(float("nan"))
    assert int(call.layer(0).stage_from) == 4  # the op's: where a layer holding it starts
    for layer in range(cache.num_layers):
        q, k = torch.randn(8, 2, 4), torch.randn(8, 1, 4)
        call.attend(layer, q, k, k)
    assert call.stage_from == kept.stage_from == 0
    assert not cache.stage_k[:, :24].isnan().any()  # every layer restaged from block 0
    # Now the buffers hold it: the next forward keeps the history blocks, and says so.
    again = ForwardCall(cache, pair.plans(BOTH[:1], commit=False)[0], softmax_scale=0.5)
    cache.stage_k.fill_(float("nan"))
    for layer in range(cache.num_layers):
        again.attend(layer, torch.randn(8, 2, 4), torch.randn(8, 1, 4), torch.randn(8, 1, 4))
    assert again.stage_from == again.plans[0].stage_from == 4
    assert cache.stage_k[:, :16].isnan().all() and not cache.stage_k[:, 16:24].isnan().any()
    # A batch attends over the paged cache: -1 for the call and each of its plans.
    batch = ForwardCall(cache, pair.plans(BOTH, commit=False)[0], softmax_scale=0.5)
    assert batch.stage_from == -1
    batch.layer(0)
    assert batch.stage_from == -1 and [plan.stage_from for plan in batch.plans] == [-1, -1]


@pytest.mark.usefixtures("plain")
def test_a_call_that_fails_mid_restage_leaves_nothing_reusable() -> None:
    # The positive history is staged; a negative forward restages over it and fails before it
    # attends. The layer's tag, cleared when the call started, must not still name the
    # positive history, or the next positive forward would keep the negative rows.
    pair = twin()
    for branch in (BOTH[:1], BOTH[:1], BOTH[1:]):
        pair.forward(branch, commit=True)
    pair.forward(BOTH[:1], commit=False)
    cache = pair.staged
    held = cache.stage_tags.clone()

    def restage_then_fail(*args, **kwargs) -> None:
        gather_blocks(*args, **kwargs)
        raise RuntimeError("the device went away mid-restage")

    call = ForwardCall(cache, pair.plans(BOTH[1:], commit=False)[0], softmax_scale=0.5)
    failing = mock.patch.object(fused, "gather_blocks", restage_then_fail)
    with failing, pytest.raises(RuntimeError, match="mid-restage"):
        call.attend(0, torch.randn(8, 2, 4), torch.randn(8, 1, 4), torch.randn(8, 1, 4))
    assert int(cache.stage_tags[0]) == -1 and cache.stage_tags[1] == held[1]
    pair.forward(BOTH[:1], commit=False)  # staged output equals unstaged, bit for bit


# Blocks of 2, chunks of 5: the staged window is 10 blocks, 20 keys. Attended as one block of 20
# it took a launch of its own (16 + 4 keys, two softmax steps, where the paged blocks of 2 take
# one) and differed from the unstaged output by a float32 step.
SMALL_BLOCKS = PagingConfig(
    block_size=2, chunk_size=5, sink_chunks=1, window_chunks=2, max_forward_chunks=2
)
POOLS = {
    "float32": {},
    "int8": {"kv_dtype": torch.int8},
    "exact-window": {"exact_window": True},
    "int8-keys-major": {"kv_dtype": torch.int8, "keys_major": True},
    "k8v8": {"kv_format": "k8v8"},
    "k8v16": {"kv_format": "k8v16"},
}


@pytest.mark.parametrize("pools", POOLS.values(), ids=POOLS.keys())
def test_kernels_staged_equal_unstaged_bit_for_bit(pools: dict) -> None:
    # One session, one layer: commit 1 frame, then 2, then 2 (Twin.run checks each output).
    pair = Twin(dataclasses.replace(SMALL_BLOCKS, **pools), num_layers=1)
    pair.open()
    for chunks in (1, 2, 2):
        pair.forward([(0, "main")], chunks, commit=True)


@pytest.mark.parametrize("pools", ["int8", "k8v8", "k8v16"])
def test_regrown_factors_rescale_the_staged_history(pools: str) -> None:
    # A probe repeated over one history keeps its staged rows; the second probe's keys have 4
    # channels of KV head 0 100x wider (its queries' 100x narrower), which regrows that head's
    # K factors (``kernels.regrow``): the staged rows must be rescaled as the pool's are, or
    # the staged output differs from the unstaged one (Twin.run checks each, bit for bit).
    config = dataclasses.replace(
        PagingConfig(block_size=16, chunk_size=64, sink_chunks=1, window_chunks=2),
        **POOLS[pools],
    )
    pair = Twin(config, num_layers=1, num_kv_heads=2, head_dim=16)
    pair.open()
    pair.forward([(0, "main")], commit=True)
    pair.forward([(0, "main")], commit=False)
    chosen = pair.staged.k_equalizers[0].clone()
    gain = torch.ones(2, 16)
    gain[0, :4] = 100.0
    pair.key_gain = gain
    # The grown channels' logits as before, so the history's rows keep their weight.
    pair.query_gain = 1.0 / gain.amax(dim=0)
    spy = mock.patch.object(fused, "gather_blocks", wraps=gather_blocks)
    with spy as restages:
        pair.forward([(0, "main")], commit=False)
    assert restages.call_args.kwargs["first_block"] > 0, "the probe must keep its staged history"
    regrown = pair.staged.k_equalizers[0]
    assert (regrown[0, :4] > chosen[0, :4]).all() and torch.equal(regrown[1], chosen[1])


@st.composite
def staged_runs(draw) -> tuple[PagingConfig, list[tuple[int, bool, int]], int]:
    """A small geometry, a pool format and three single-row forwards (chunks, commit, action
    tokens) of one session."""
    window = draw(st.integers(1, 3))
    config = PagingConfig(
        block_size=draw(st.integers(1, 8)),
        chunk_size=draw(st.integers(1, 8)),
        sink_chunks=draw(st.integers(0, 2)),
        window_chunks=window,
        max_forward_chunks=draw(st.integers(1, min(2, window))),
        max_action_tokens=draw(st.sampled_from([0, 3])),
        **{**draw(st.sampled_from(list(POOLS.values()))), "exact_window": draw(st.booleans())},
    )
    forward = st.tuples(
        st.integers(1, config.max_forward_chunks),
        st.booleans(),
        st.sampled_from([0, config.max_action_tokens]),
    )
    return config, draw(st.lists(forward, min_size=3, max_size=3)), draw(st.integers(0, 99))


@settings(max_examples=3)
@given(run=staged_runs())
@example(run=(dataclasses.replace(SMALL_BLOCKS, block_size=3), [(2, True, 0)] * 3, 1))
def test_kernels_staged_equal_unstaged_on_random_geometries(run) -> None:
    config, forwards, seed = run
    pair = Twin(config, num_layers=1, seed=seed)
    pair.open()
    for chunks, commit, actions in forwards:
        pair.forward([(0, "main")], chunks, commit=commit, actions=actions)


@pytest.mark.parametrize("lengths", [(2, 2), (1, 2)], ids=["even", "ragged"])
@pytest.mark.parametrize("pools", ["float32", "int8"])
def test_kernels_single_staged_row_equals_its_row_in_a_batch(pools: str, lengths) -> None:
    # Both caches hold the same two-branch history (batched forwards attend over the paged
    # pools on both); then each branch alone on the staged cache, and both as one batch on the
    # unstaged one (rows of 2 and 2 frames, or 1 and 2: the batch's query tile is the longer
    # row's): each row of the batch equals the staged single-row output bit for bit.
    config = dataclasses.replace(SMALL_BLOCKS, **POOLS[pools])
    pair = Twin(config, branches=("positive", "negative"), num_layers=1)
    pair.open()
    for chunks in (1, 2):
        pair.forward(BOTH, chunks, commit=True)
    # A row of two frames reads 17 keys, past the 16 of the first piece a block of 20 was cut
    # into.
    sizes = [chunks * SMALL_BLOCKS.chunk_size for chunks in lengths]
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(sum(sizes), h, 4, generator=gen) for h in (2, 1, 1))
    plans = [
        pair.caches[1].plan(pair.sessions[0][1], b, n, commit=False)
        for (_, b), n in zip(BOTH, sizes, strict=True)
    ]
    batch = ForwardCall(pair.caches[1], plans, softmax_scale=0.5)
    batched = batch.attend(0, q, k, v)
    starts = [0, sizes[0]]
    for (s, branch), start, n in zip(BOTH, starts, sizes, strict=True):
        plan = pair.staged.plan(pair.sessions[s][0], branch, n, commit=False)
        single = ForwardCall(pair.staged, plan, softmax_scale=0.5)
        rows = slice(start, start + n)
        out = single.attend(0, q[rows], k[rows], v[rows])
        assert single.stage_from == 0, "the staged path did not run"
        assert torch.equal(out, batched[rows]), f"row {branch}"


attention_module = importlib.import_module("paged_video.kernels.paged_attention")
# Slot-major pools of a bfloat16 cache: 16-bit (the table's "same" rows) or quantized.
GPU_POOLS = {"bf16": {}, **{name: POOLS[name] for name in ("int8",)}}


def gpu_launches(config: PagingConfig, head_dim: int) -> list[dict]:
    """The launcher's GPU tile choices (``choose_tiles``: its arguments and its result) for a
    forward of 1 then 2 frames on a bfloat16 cache of ``config``; the kernels then take the
    plain-PyTorch path on the CPU."""
    launches = []

    def spy(**kwargs) -> dict:
        tiles = choose_tiles(**kwargs)
        launches.append({**kwargs, **tiles})
        return tiles

    choose_tiles = attention_module.choose_tiles
    cache = PagedKVCache(
        config, num_layers=1, num_kv_heads=1, head_dim=head_dim, dtype=torch.bfloat16
    )
    session = cache.open_session()
    gpu = mock.patch.object(attention_module, "interpreter_active", return_value=False)
    with plain_torch_kernels(), gpu, mock.patch.object(attention_module, "choose_tiles", spy):
        for chunks in (1, 2):
            n = chunks * config.chunk_size
            call = ForwardCall(
                cache, cache.plan(session, "main", n, commit=True), softmax_scale=0.1
            )
            q, k = torch.randn(n, 1, head_dim), torch.randn(n, 1, head_dim)
            call.attend(0, *(t.to(torch.bfloat16) for t in (q, k, k)))
            call.commit()
    return launches


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [7, 16, 24, 520])
@pytest.mark.parametrize("pools", GPU_POOLS)
def test_gpu_staged_launch_is_the_paged_one(pools: str, block_size: int, head_dim: int) -> None:
    # On a GPU the launch table picks the tile, variant and key loop per block size, key path
    # and pool layout: a staged forward must get the paged forward's launch (equal outputs need
    # one order of float32 sums), over slot-major pools (keys-major ones: docs/paging.md).
    config = PagingConfig(
        block_size=block_size,
        chunk_size=block_size + 3,
        sink_chunks=1,
        window_chunks=2,
        max_forward_chunks=2,
        **GPU_POOLS[pools],
    )
    staged, paged = (
        gpu_launches(dataclasses.replace(config, reuse_history_staging=on), head_dim)
        for on in (True, False)
    )
    assert len(staged) == 2 and staged == paged
