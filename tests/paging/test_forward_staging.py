"""History staging through ``ForwardCall``: staged and unstaged caches agree bit for bit after
batched forwards, dropped, cancelled and abandoned plans, and the reuse still happens.

The short scenarios run the Triton kernels; the longer sequences take the plain-PyTorch path
(``plain``), since what they test is the staging record, not the kernels.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from paged_video.kernels import fused
from paged_video.kernels.gather_blocks import gather_blocks
from paged_video.paging import PagingConfig
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
