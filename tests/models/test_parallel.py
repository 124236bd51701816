"""Ulysses and CFG parallel rollouts over gloo equal the single-process paged rollout.

The test spawns 2 (and 4) processes with ``torch.multiprocessing`` on 127.0.0.1 (a free port,
gloo on the loopback interface); each rank runs ``tests/models/parallel_worker.py`` under the
Triton interpreter with one thread and saves its results. A hard deadline kills the ranks and
fails the test instead of hanging; every collective also times out on its own after 60 s.
While the ranks run, this process makes the single-process paged rollouts they must equal.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("diffusers")

import torch.distributed as dist
import torch.multiprocessing as mp

from paged_video.kernels.fused import write_attend
from paged_video.models import parallel
from paged_video.models.parallel import (
    ParallelGroups,
    ParallelLayout,
    ParallelWanRollout,
    plan_digest,
)
from paged_video.models.wan_paged import CFG_BRANCHES, PagedWanRollout
from paged_video.paging import PagedKVCache, PagingConfig
from paged_video.paging.forward import ForwardCall
from tests.models import parallel_worker
from tests.models.parallel_worker import (
    BLOCKS,
    CFG,
    FOUR,
    ULYSSES,
    ULYSSES_INT8,
    ULYSSES_K8V8,
    UNGUIDED,
    paging_config,
    rollout,
)
from tests.models.tiny import (
    ATOL,
    RTOL,
    TOKENS_PER_FRAME,
    assert_close_to_quantized_oracle,
    rollout_inputs,
    tiny_wan,
)
from tests.paging.test_shard_attention import bits
from tests.paging.twin import plain_torch_kernels, poison

README = Path(__file__).resolve().parents[2] / "README.md"

DEADLINE_S = 360.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(scenario: str, world_size: int, out_dir: Path, monkeypatch, while_running=None):
    """Run ``scenario`` on ``world_size`` ranks; the results of each rank, and of
    ``while_running()`` computed here meanwhile. Fails (ranks killed) past ``DEADLINE_S``."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.setenv(name, "1")
    if sys.platform.startswith("linux"):
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    deadline = time.monotonic() + DEADLINE_S
    context = mp.spawn(
        parallel_worker.run,
        args=(free_port(), world_size, scenario, str(out_dir)),
        nprocs=world_size,
        join=False,
    )
    try:
        local = while_running() if while_running is not None else None
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"{world_size} ranks of {scenario!r} ran past {DEADLINE_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    ranks = [torch.load(out_dir / f"{scenario}-rank{r}.pt") for r in range(world_size)]
    return ranks, local


def test_two_ranks_equal_one_process_and_diverged_plans_fail_on_both(tmp_path, monkeypatch):
    """One spawn of 2 ranks for every 2-rank check (one test, so xdist never spawns it twice)."""

    def single():
        return {
            "ulysses": rollout(ULYSSES, PagedWanRollout),
            "ulysses_int8": rollout(ULYSSES_INT8, PagedWanRollout),
            "ulysses_k8v8": rollout(ULYSSES_K8V8, PagedWanRollout),
            "unguided": rollout(UNGUIDED, PagedWanRollout),
            "cfg": rollout(CFG, PagedWanRollout),
        }

    ranks, single = spawn("two", 2, tmp_path, monkeypatch, single)
    check_ulysses(ranks, single)
    check_quantized_ulysses(ranks, single)
    check_k8v8_ulysses(ranks, single)
    check_unguided_staged_ulysses(ranks, single)
    check_cfg_parallel(ranks, single)
    check_divergence(ranks)
    for rank in ranks:  # refused before anything changed: the model keeps its processors
        assert [(kind, stock) for kind, _, stock in rank["refused"]] == [("ValueError", True)] * 3
        messages = [message for _, message, _ in rank["refused"]]
        assert "divide the model's heads (3)" in messages[0]
        assert "divide config.chunk_size (25" in messages[1]
        assert "guidance=True" in messages[2]


def assert_same_rollout(rank: dict, single: dict, branches: tuple[str, ...]) -> None:
    got, want = rank["latents"], single["latents"]
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    for ours, theirs in zip(rank["positions"], single["positions"], strict=True):
        for read, reference in zip(ours, theirs, strict=True):
            for branch in branches:
                assert read[branch] == reference[branch]


def check_ulysses(ranks: list[dict], single: dict) -> None:
    # 8 blocks of one 24-token frame, sink 1, window 3 (the window slides from block 3 on),
    # blocks of 16 tokens, 3 action tokens, both CFG branches in each rank's one launch.
    for rank in ranks:
        assert_same_rollout(rank["ulysses"], single["ulysses"], ("positive", "negative"))
    # Eviction happened: the last forward read the sink and the last three frames only.
    last = ranks[0]["ulysses"]["positions"][-1][0]["positive"]
    assert last == [*range(TOKENS_PER_FRAME), *range(5 * 24, 8 * 24)]
    assert single["ulysses"]["latents"].shape[2] == BLOCKS
    # Each rank's pools hold half the heads: half the bytes.
    for rank in ranks:
        assert rank["ulysses"]["kv_heads"] * 2 == single["ulysses"]["kv_heads"]
        assert rank["ulysses"]["num_blocks"] == single["ulysses"]["num_blocks"]
        assert rank["ulysses"]["pool_bytes"] * 2 == single["ulysses"]["pool_bytes"]


def check_k8v8_ulysses(ranks: list[dict], single: dict) -> None:
    # The Ulysses rollout on k8v8 pools against the single-process one on k8v8 pools, relative
    # to what the format does (the float rollouts of the same case); each rank's frozen V
    # channel scales are the single process's of its KV heads (every token of them is there:
    # float32 rounding of the sharded projections apart), so they shard with the heads.
    want = single["ulysses_k8v8"]
    scales = want["v_channel_scales"][:, 0]
    assert scales.shape[1] == want["kv_heads"] and (scales > 0).all()
    for index, rank in enumerate(ranks):
        got = rank["ulysses_k8v8"]
        unquantized = single["ulysses"]["latents"]
        assert_close_to_quantized_oracle(got["latents"], want["latents"], unquantized, "k8v8")
        assert got["positions"] == want["positions"]
        heads = got["kv_heads"]
        mine = scales[:, index * heads : (index + 1) * heads]
        torch.testing.assert_close(got["v_channel_scales"][:, 0], mine, rtol=1e-5, atol=0)


def check_quantized_ulysses(ranks: list[dict], single: dict) -> None:
    # The Ulysses rollout on int8 pools (K smoothing on) against the single-process one on int8
    # pools, relative to what quantizing does (the float rollouts of the same case); each
    # rank's pools, scales and K means are half the single process's.
    for rank in ranks:
        got, want = rank["ulysses_int8"], single["ulysses_int8"]
        unquantized = single["ulysses"]["latents"]
        assert_close_to_quantized_oracle(got["latents"], want["latents"], unquantized, "int8")
        assert got["positions"] == want["positions"]
        assert got["pool_bytes"] * 2 == want["pool_bytes"]
        assert want["pool_bytes"] < single["ulysses"]["pool_bytes"] / 2


def check_unguided_staged_ulysses(ranks: list[dict], single: dict) -> None:
    # One branch, two frames (48 tokens, three whole 16-token blocks) per block, window 4, no
    # sink, staged: each committing forward restages only its own blocks, on every rank.
    for rank in ranks:
        assert_same_rollout(rank["unguided"], single["unguided"], ("main",))
        assert rank["unguided"]["stage_from"] == single["unguided"]["stage_from"]
        assert all(commit > 0 for _, commit in rank["unguided"]["stage_from"][1:])
        assert rank["unguided"]["pool_bytes"] * 2 == single["unguided"]["pool_bytes"]


def check_cfg_parallel(ranks: list[dict], single: dict) -> None:
    # One branch per rank (one row, so the history staging buffers are used), two frames per
    # block, window 4: the guided flow is combined by one all-gather per denoising step.
    assert [rank["cfg"]["branches"] for rank in ranks] == [("positive",), ("negative",)]
    for rank in ranks:
        assert_same_rollout(rank["cfg"], single["cfg"], rank["cfg"]["branches"])
    torch.testing.assert_close(ranks[0]["cfg"]["latents"], ranks[1]["cfg"]["latents"])
    # Same heads, one branch's sequences and scratch lanes: half the blocks after the null one.
    for rank in ranks:
        assert rank["cfg"]["kv_heads"] == single["cfg"]["kv_heads"]
        assert 2 * (rank["cfg"]["num_blocks"] - 1) == single["cfg"]["num_blocks"] - 1
        per_block = single["cfg"]["pool_bytes"] // single["cfg"]["num_blocks"]
        assert rank["cfg"]["pool_bytes"] == per_block * rank["cfg"]["num_blocks"]


def check_divergence(ranks: list[dict]) -> None:
    # A rank with another window: the configurations differ, seen before the first forward.
    for rank in ranks:
        assert rank["config_diverged"].startswith("PlanDivergenceError"), rank["config_diverged"]
        assert "the start of the rollout: config (ranks [1])" in rank["config_diverged"]
    # A rank whose pool handed out other block ids from block 1's committing forward on.
    for rank in ranks:
        assert rank["block_diverged"].startswith("PlanDivergenceError"), rank["block_diverged"]
        assert "block 1, forward 1" in rank["block_diverged"]
    assert ranks[0]["block_diverged"] == ranks[1]["block_diverged"]


@pytest.mark.parametrize(
    "pools",
    [{"kv_dtype": torch.int8}, {"kv_format": "k8v8"}, {"kv_format": "k8v16"}],
    ids=["int8", "k8v8", "k8v16"],
)
def test_cfg_ranks_store_the_single_process_codes(pools, monkeypatch):
    # What each CFG rank's processor does (``ParallelWanRollout``): before a layer's write,
    # ``_choose_across_branches`` with its branch's K/V (the CFG all-gather stands in, handing
    # both branches' K/V, positive first, as gloo does; the 2-rank collective itself runs in
    # tests/models/test_sharded_window.py), then the fused op on its one-branch cache. Each
    # rank must freeze what one process's batched forward chooses from both branches (K mean,
    # factors, k8v8's V channel scales), so the blocks of its branch hold one process's codes
    # and scales bit for bit; a rank that chose from its branch alone differs.
    config = PagingConfig(
        block_size=3,
        chunk_size=4,
        sink_chunks=1,
        window_chunks=2,
        max_forward_chunks=2,
        **pools,
        smooth_keys=True,
        equalize_channels=True,
    )
    geometry = dict(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    single = PagedKVCache(config, branches=CFG_BRANCHES, **geometry)
    ranks = [PagedKVCache(config, branches=(branch,), **geometry) for branch in CFG_BRANCHES]
    for cache in (single, *ranks):
        poison(cache)
    sessions = [cache.open_session() for cache in (single, *ranks)]
    gathered = {}
    monkeypatch.setattr(parallel, "all_gather", lambda kv, *_: gathered["kv"])
    generator = torch.Generator().manual_seed(7)
    offsets = 8 * torch.randn(2, 16, generator=generator)  # what smoothing removes
    with plain_torch_kernels():  # (the kernels are checked against the oracle elsewhere)
        for chunks, commit in [(2, False), (2, True), (1, True)]:
            n = chunks * config.chunk_size
            plans = [single.plan(sessions[0], branch, n, commit=commit) for branch in CFG_BRANCHES]
            calls = [ForwardCall(single, plans, softmax_scale=0.25)]
            for cache, session, branch in zip(ranks, sessions[1:], CFG_BRANCHES, strict=True):
                plan = cache.plan(session, branch, n, commit=commit)
                calls.append(ForwardCall(cache, plan, softmax_scale=0.25))
            for layer in range(2):
                q = torch.randn(2 * n, 4, 16, generator=generator)
                gains = torch.exp2(6 * torch.rand(2, 2 * n, 2, 16, generator=generator))
                gains[..., 8:] = 1  # outlier channels 0-7
                k, v = torch.randn(2, 2 * n, 2, 16, generator=generator) * gains
                k = k + offsets
                # (rank, K or V, the branch's rows): what the all-gather of each rank's
                # stacked K/V returns.
                gathered["kv"] = torch.stack([k, v]).unflatten(1, (2, n)).transpose(0, 1)
                want = cfg_rank_attends(calls[0], layer, q, k, v)
                for index, call in enumerate(calls[1:]):
                    rows = slice(index * n, (index + 1) * n)
                    got = cfg_rank_attends(call, layer, q[rows], k[rows], v[rows], choose=True)
                    torch.testing.assert_close(got, want[rows], atol=1e-6, rtol=1e-6)
            for call in calls:
                call.commit()
    assert (single.k_equalizers > 1).any() and single.k_means.abs().max() > 1
    for cache, session, branch in zip(ranks, sessions[1:], CFG_BRANCHES, strict=True):
        for name in ("k_means", "k_equalizers", "v_equalizers", "v_channel_scales"):
            mine, theirs = getattr(cache, name), getattr(single, name)
            if name == "v_channel_scales" and theirs.numel():  # one block of each (stride 0)
                mine, theirs = mine[:, 0], theirs[:, 0]
                assert (theirs > 0).all()
            assert torch.equal(mine, theirs), name
        mine = session.sequences[branch].block_table
        theirs = sessions[0].sequences[branch].block_table
        assert len(mine) == len(theirs) and sum(b != 0 for b in mine) > 2
        for name in ("k_pools", "v_pools", "k_scales", "v_scales"):
            for ours, reference in zip(mine, theirs, strict=True):
                if ours and getattr(single, name).numel():
                    got, expected = getattr(cache, name), getattr(single, name)
                    assert torch.equal(bits(got[:, ours]), bits(expected[:, reference])), name


def cfg_rank_attends(call, layer, q, k, v, choose=False):
    """The fused op over ``call``'s cache, after a CFG rank's choice when ``choose``."""
    if choose:
        rank = SimpleNamespace(groups=SimpleNamespace(cfg=None), guard=None)
        ParallelWanRollout._choose_across_branches(rank, call, layer, k, v)
    none = k[:0]
    return write_attend(q, k, v, none, none, call.cache.pool_tensors, call.layer(layer))


def test_ulysses_times_cfg_on_four_ranks(tmp_path, monkeypatch):
    # Ranks 0, 1 hold the positive branch, 2, 3 the negative; each pair splits the heads.
    layout = ParallelLayout(ulysses_degree=2, cfg_degree=2)
    assert layout.ulysses_groups() == [[0, 1], [2, 3]]
    assert layout.cfg_groups() == [[0, 2], [1, 3]]
    ranks, _ = spawn("four", 4, tmp_path, monkeypatch)
    for r, rank in enumerate(ranks):
        cfg_index, kv_shard_index, ulysses_index = layout.coordinates(r)
        assert kv_shard_index == 0
        assert rank["coordinates"] == (cfg_index, ulysses_index)
        assert rank["members"] == {
            "ulysses": layout.ulysses_groups()[cfg_index],
            "cfg": layout.cfg_groups()[ulysses_index],
        }
        # Within the Ulysses pair: every token of this rank's two heads, and back again.
        mine = slice(2 * ulysses_index, 2 * ulysses_index + 2)
        assert torch.equal(rank["heads"], rank["full"][:, :, :, mine])
        assert torch.equal(rank["back"], rank["shard"][0])
    # The two CFG branches had different tensors: no all-to-all crossed the pairs.
    assert not torch.equal(ranks[0]["full"], ranks[2]["full"])


@pytest.mark.skipif(
    os.environ.get("PARALLEL_FOUR_RANK_ROLLOUT") != "1",
    reason="4 ranks importing diffusers on 2 cores: opt in with PARALLEL_FOUR_RANK_ROLLOUT=1",
)
def test_ulysses_times_cfg_rollout_on_four_ranks(tmp_path, monkeypatch):
    ranks, single = spawn(
        "four_rollout", 4, tmp_path, monkeypatch, lambda: rollout(FOUR, PagedWanRollout)
    )
    for r, rank in enumerate(ranks):
        assert rank["branches"] == (("positive",), ("negative",))[r // 2]
        assert rank["kv_heads"] * 2 == single["kv_heads"]
        assert_same_rollout(rank, single, rank["branches"])


def test_layout_rejects_bad_degrees():
    with pytest.raises(ValueError, match="cfg_degree"):
        ParallelLayout(cfg_degree=3)
    with pytest.raises(ValueError, match="ulysses_degree"):
        ParallelLayout(ulysses_degree=0)
    with pytest.raises(TypeError, match="ulysses_degree"):
        ParallelLayout(ulysses_degree=2.0)
    with pytest.raises(ValueError, match="rank"):
        ParallelLayout(ulysses_degree=2).coordinates(2)


@pytest.fixture
def world_of_one():
    """A gloo world of one rank in this process, on an in-memory store (no network)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield ParallelGroups(ParallelLayout())
    finally:
        dist.destroy_process_group()


def test_plan_check_runs_each_forward_and_switches_off(world_of_one, monkeypatch):
    digests = []
    checked = parallel.check_plans_agree
    monkeypatch.setattr(
        parallel, "check_plans_agree", lambda *a: digests.append(a[2]) or checked(*a)
    )
    inputs = rollout_inputs(1, blocks=1)
    for check in (True, False):
        with ParallelWanRollout(
            tiny_wan(), paging_config(), world_of_one, check_plans=check
        ) as paged:
            paged.generate(
                inputs.noise, inputs.prompt, inputs.negative, frames_per_block=1, sigmas=(1.0,)
            )
    assert digests == ["block 0, forward 0", "block 0, forward 1"]  # none with check_plans=False


def test_groups_need_an_initialised_world_of_the_layout_size(world_of_one):
    with pytest.raises(ValueError, match="kv_shard_degree = 2"):
        ParallelGroups(ParallelLayout(ulysses_degree=2))
    with pytest.raises(TypeError, match="layout"):
        ParallelGroups((2, 1))
    with pytest.raises(TypeError, match="groups"):
        ParallelWanRollout(tiny_wan(), paging_config(), None)


def test_plan_digest_tells_plans_apart():
    def digest_after(commits: int, stolen: int = 0):
        cache = PagedKVCache(paging_config(), num_layers=1, num_kv_heads=1, head_dim=4)
        session = cache.open_session()
        cache.pool.allocate(stolen)  # a rank whose pool handed out blocks elsewhere
        for _ in range(commits):
            call = ForwardCall(
                cache, cache.plan(session, "main", TOKENS_PER_FRAME, commit=True), softmax_scale=1.0
            )
            call.commit()
        call = ForwardCall(cache, cache.plan(session, "main", TOKENS_PER_FRAME), softmax_scale=1.0)
        return plan_digest(call)

    assert torch.equal(digest_after(2), digest_after(2))
    assert not torch.equal(digest_after(2), digest_after(3))  # another history
    assert not torch.equal(digest_after(2), digest_after(2, stolen=1))  # other block ids


def test_readme_block_runs_as_a_world_of_one(monkeypatch):
    # The README's torchrun script, run alone: a world of one rank on an in-memory store.
    monkeypatch.delenv("RANK", raising=False)
    section = README.read_text().split("## Beyond one GPU", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # One rank holds both branches and every head: pools (layers, blocks, 16, 2 heads, 32).
    assert printed.getvalue().split(" ", 1) == [
        "0",
        "torch.Size([1, 4, 3, 8, 12]) torch.Size([2, 19, 16, 2, 32])\n",
    ]
