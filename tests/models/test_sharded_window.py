"""A sequence-sharded window over gloo equals the single-process paged rollout; ranks that
diverge, raise or die make every rank raise within seconds.

The ranks (``tests/models/sharded_worker.py``) run on 127.0.0.1 with the kernels' plain-PyTorch
path; meanwhile this process makes the single-process rollouts they must equal, on the same
path. Hard deadline per world: ``DEADLINE_S``.

Tolerance: the ranks' latents equal the single process's within ``ATOL``/``RTOL`` (5e-5, the
fp32 rollout tolerance of ``tests/models/tiny.py``). A rank's attention is the exact merge of
``N`` float32 partial attentions (``exp(lse_i - max)`` weights, float32 sums) where the single
process runs one online softmax over the same keys in another order: each output differs by a
few float32 roundings (~1e-7 relative), and the rollout's 2 layers and 8 blocks carry that to
~2e-6 in the latents (measured: 1.5e-6 to 1.8e-6 over these cases), far inside 5e-5 and far
below what a wrong key set does (a missing frame or boundary token moves latents by ~1e-2).
Over quantized pools (int8 over 2 and 4 shards, k8v16 under Ulysses x shards; smoothing and
equalization on, channels 16x wider) that rounding flips codes, so there the ranks are measured
against the quantization's own effect (``assert_same_quantized_rollout``).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("diffusers")

from paged_video.models.parallel import ParallelLayout
from paged_video.models.wan_paged import PagedWanRollout
from paged_video.paging import window as paging_window
from tests.models import ranks, sharded_worker
from tests.models.parallel_worker import CHOSEN, paging_config, rollout
from tests.models.sharded_worker import (
    FAIL_BLOCK,
    SHARDED,
    SHARDED_INT8,
    SHARDED_K8V8,
    SHARDED_K8V16,
    SHARDED_KEPT,
    SHARDED_STAGED,
)
from tests.models.tiny import ATOL, RTOL, assert_within_flipped_codes
from tests.paging.twin import plain_torch_kernels

DEADLINE_S = 420.0
RAISE_WITHIN_S = 10.0


def spawn(scenario: str, world_size: int, tmp_path, monkeypatch, while_running) -> tuple:
    """The saved results of each rank of ``scenario`` (None for a rank that saved nothing),
    and ``while_running()``, computed here meanwhile."""
    processes = ranks.start(
        sharded_worker.run,
        world_size,
        (scenario, str(tmp_path)),
        monkeypatch,
        TRITON_INTERPRET="0",
    )
    try:
        with plain_torch_kernels():
            local = while_running()
    finally:
        codes = ranks.wait(processes, DEADLINE_S)
    results = []
    for rank in range(world_size):
        path = tmp_path / f"{scenario}-rank{rank}.pt"
        results.append(torch.load(path) if path.exists() else None)
    return results, codes, local


def assert_same_rollout(got: dict, want: dict) -> None:
    assert not torch.isnan(got["latents"]).any()
    torch.testing.assert_close(got["latents"], want["latents"], atol=ATOL, rtol=RTOL)
    for ours, theirs in zip(got["positions"], want["positions"], strict=True):
        for read, reference in zip(ours, theirs, strict=True):
            for branch, positions in read.items():
                assert positions == reference[branch]


def unquantized(case: dict) -> dict:
    """``case`` over float pools: what its quantization is measured against."""
    config = dict(case["config"], kv_dtype=None, kv_format=None, equalize_channels=None)
    return dict(case, config=config)


def quantized_rollouts(case: dict) -> dict:
    """The single process's rollout of quantized ``case``, and of its float twin."""
    return {
        "quantized": rollout(case, PagedWanRollout),
        "float": rollout(unquantized(case), PagedWanRollout),
    }


def assert_same_quantized_rollout(
    results: list, want: dict, ulysses: int = 1, window_shards: bool = False
) -> None:
    """Quantized pools: each rank froze the single process's K mean and factors (of its heads;
    the mean up to float32 rounding, its K coming from projections of token shards or of one
    branch; the ranks of a head shard alike, bit for bit), and its latents are the single
    process's up to codes that flip on that rounding (``assert_within_flipped_codes``). Ranks
    that choose from their own tokens or branch miss the mean by 0.5 to 6.
    (``tests/paging/test_shard_attention.py`` checks the codes bit for bit, from equal K/V.)

    k8v8 over ``window_shards``: each rank rounds its probabilities to e4m3 against its own row
    maximum, so a layer's merged output is ~0.1% from one process's and the next layer chooses
    from inputs that differ so much: layer 0's choice as above, later layers' mean and V
    channel scales within 1% (mean difference; measured 0.13% and 0.04%), and the latents, over
    8 blocks, as far from one process's as the format is from the float rollout (measured 86%
    and 87% of its mean effect) but no farther from the float rollout (measured 0.90x one
    process's)."""
    single = want["quantized"]
    heads = single["k_means"].shape[1] // ulysses
    # k8v8 and k8v16 equalize K only (V has frozen channel scales, or is stored as it is).
    assert (single["k_equalizers"] > 1).any()
    assert (single["v_equalizers"] > 1).any() == (single["kv_format"] is None)
    exact = 1 if window_shards and single["kv_format"] == "k8v8" else None  # layers
    unquantized = want["float"]["latents"]
    for r, rank in enumerate(results):
        own = slice(r % ulysses * heads, (r % ulysses + 1) * heads)
        for name in CHOSEN:
            if single[name].numel() == 0:  # a state this format has none of (k8v8's V scales)
                assert rank[name].numel() == 0, name
                continue
            mine, theirs = rank[name], single[name]
            if name == "v_channel_scales":  # k8v8's, frozen: one block of each, block stride 0
                mine, theirs = mine[:, 0], theirs[:, 0]
                assert (theirs > 0).all()
            theirs = theirs[:, own]
            if name in ("k_means", "v_channel_scales"):  # up to float32 rounding
                atol, rtol = (1e-5, 0) if name == "k_means" else (0, 1e-5)
                torch.testing.assert_close(mine[:exact], theirs[:exact], atol=atol, rtol=rtol)
                if exact is not None:
                    apart = (mine[exact:] - theirs[exact:]).abs().mean()
                    assert apart <= 1e-2 * theirs[exact:].abs().mean(), (name, apart)
            else:
                assert torch.equal(mine, theirs), name
            assert torch.equal(rank[name], results[r % ulysses][name]), name
        if exact is None:
            assert_within_flipped_codes(rank["latents"], single["latents"], unquantized)
        else:  # another rounding of P, as accurate: within the format's effect, no worse
            assert_within_flipped_codes(rank["latents"], single["latents"], unquantized, 1.0)
            error = (rank["latents"] - unquantized).abs().mean()
            assert error <= 1.1 * (single["latents"] - unquantized).abs().mean()
        for ours, theirs in zip(rank["positions"], single["positions"], strict=True):
            for read, reference in zip(ours, theirs, strict=True):
                assert read == {branch: reference[branch] for branch in read}


def shard_blocks(case: dict, degree: int, branches: int) -> int:
    """The physical blocks of one rank's cache (``paging.shard``): its share of each
    sequence's sink and other blocks, of each scratch lane, and the null block."""
    config = paging_config(**case["config"])
    sink = paging_window.sink_blocks(config)
    rest = paging_window.blocks_per_sequence(config) - sink
    lane = paging_window.scratch_blocks_per_sequence(config)
    per_sequence = math.ceil(sink / degree) + math.ceil(rest / degree) + math.ceil(lane / degree)
    return 1 + branches * per_sequence


def assert_raised_in_time(results: list, failing: int, cause: str) -> None:
    failed_at = results[failing]["failed_at"]
    for rank, result in enumerate(results):
        if rank == failing:
            continue
        error = result["killed" if "killed" in result else "raised"]
        assert error["error"].startswith("RankFailedError: rank "), error
        assert cause in error["error"], error
        assert error["at"] - failed_at < RAISE_WITHIN_S


def test_two_window_shards_equal_one_process_and_fail_together(tmp_path, monkeypatch):
    def single():
        return {
            "sharded": rollout(SHARDED, PagedWanRollout),
            "staged": rollout(SHARDED_STAGED, PagedWanRollout),
            "kept": rollout(SHARDED_KEPT, PagedWanRollout),
            "int8": quantized_rollouts(SHARDED_INT8),
            "k8v8": quantized_rollouts(SHARDED_K8V8),
            "k8v16": quantized_rollouts(SHARDED_K8V16),
        }

    results, codes, want = spawn("two", 2, tmp_path, monkeypatch, single)
    assert codes == [0, 0]
    for rank in results:
        assert_same_rollout(rank["sharded"], want["sharded"])
        assert_same_rollout(rank["staged"], want["staged"])
        assert_same_rollout(rank["kept"], want["kept"])
        for name in ("staged", "kept"):
            assert rank[name]["stage_from"] == want[name]["stage_from"]
        # Each committing forward kept the staged history (restaged from a block > 0).
        assert all(commit > 0 for _, commit in rank["kept"]["stage_from"][1:])
        assert rank["sharded"]["num_blocks"] == want["sharded"]["num_blocks"]  # the plans' ids
    for name in ("int8", "k8v8", "k8v16"):
        got = [rank[name] for rank in results]
        assert_same_quantized_rollout(got, want[name], window_shards=True)
    # Eviction happened: the last forward read the sink and the last three frames only.
    last = want["sharded"]["positions"][-1][0]["positive"]
    assert last == [*range(24), *range(5 * 24, 8 * 24)]
    # Every rank computed the same latents, bit for bit (one merge per token, then gathered).
    assert torch.equal(results[0]["sharded"]["latents"], results[1]["sharded"]["latents"])
    # Each rank's pools: its half of the window's and scratch blocks (+ at most one each).
    for case, name, branches in ((SHARDED, "sharded", 2), (SHARDED_STAGED, "staged", 1)):
        single_bytes = want[name]["pool_bytes"]
        per_block = single_bytes // want[name]["num_blocks"]
        for rank in results:
            assert rank[name]["pool_bytes"] == per_block * shard_blocks(case, 2, branches)
            assert rank[name]["pool_bytes"] <= single_bytes / 2 + 3 * branches * per_block
    # Rank 1 passed other arguments: both ranks refuse before the first forward, naming them.
    for scenario, field in (
        ("one_more_block", "blocks (ranks [1])"),
        ("other_guidance", "guidance_scale (ranks [1])"),
        ("other_noise_shape", "noise (ranks [1])"),
    ):
        for rank in results:
            error = rank[scenario]
            assert error["error"].startswith("PlanDivergenceError: the ranks disagree at the start")
            assert field in error["error"], error["error"]
            assert error["at"] - error["from"] < RAISE_WITHIN_S
    # Rank 1 raised at block 2: rank 0 raised too, with rank 1's error, within seconds.
    assert results[1]["raised"]["error"] == f"ValueError: planted failure at block {FAIL_BLOCK}"
    assert_raised_in_time(results, 1, f"rank 1: raised at block {FAIL_BLOCK}")


def test_ulysses_and_cfg_by_window_shards_on_four_ranks(tmp_path, monkeypatch):
    by_heads = ParallelLayout(ulysses_degree=2, kv_shard_degree=2)
    assert by_heads.ulysses_groups() == [[0, 1], [2, 3]]
    assert by_heads.kv_shard_groups() == [[0, 2], [1, 3]]
    assert by_heads.sequence_groups() == [[0, 1, 2, 3]]
    by_branch = ParallelLayout(cfg_degree=2, kv_shard_degree=2)
    assert by_branch.kv_shard_groups() == [[0, 1], [2, 3]]
    assert by_branch.cfg_groups() == [[0, 2], [1, 3]]

    def single():
        return {
            "float": rollout(SHARDED, PagedWanRollout),
            "int8": quantized_rollouts(SHARDED_INT8),
            "k8v8": quantized_rollouts(SHARDED_K8V8),
            "k8v16": quantized_rollouts(SHARDED_K8V16),
        }

    results, codes, single_rollouts = spawn("four", 4, tmp_path, monkeypatch, single)
    assert codes[3] == -9 and codes[:3] == [0, 0, 0], codes  # rank 3 was killed
    want = single_rollouts["float"]
    # Quantized: the window over 4 shards (int8), CFG 2 x 2 shards (int8: the CFG ranks gather
    # the first forward's K/V, so they freeze one process's state for both branches), Ulysses
    # 2 x CFG 2 (int8, no shards).
    for name in ("shards_int8", "cfg_int8"):
        assert_same_quantized_rollout([rank[name] for rank in results], single_rollouts["int8"])
    assert_same_quantized_rollout(
        [rank["ulysses_cfg_int8"] for rank in results], single_rollouts["int8"], ulysses=2
    )
    # The 8-bit formats: CFG 2 x 2 shards (k8v8's frozen V channel scales chosen from both
    # branches' tokens), Ulysses 2 x 2 shards (k8v16), Ulysses 2 x CFG 2 (no shards).
    for name, kv_format, ulysses, window_shards in (
        ("cfg_k8v8", "k8v8", 1, True),
        ("cfg_k8v16", "k8v16", 1, True),
        ("ulysses_k8v16", "k8v16", 2, True),
        ("ulysses_cfg_k8v8", "k8v8", 2, False),
        ("ulysses_cfg_k8v16", "k8v16", 2, False),
    ):
        got, single = [rank[name] for rank in results], single_rollouts[kv_format]
        assert_same_quantized_rollout(got, single, ulysses, window_shards)
    single_bytes, blocks = want["pool_bytes"], want["num_blocks"]
    for r, rank in enumerate(results):
        assert_same_rollout(rank["ulysses"], want)
        assert_same_rollout(rank["cfg"], want)
        assert rank["cfg"]["branches"] == (("positive",), ("negative",))[r // 2]
        # Half the heads and half the blocks; one branch and half the blocks.
        per_block = single_bytes // blocks
        assert rank["ulysses"]["pool_bytes"] == per_block // 2 * shard_blocks(SHARDED, 2, 2)
        assert rank["cfg"]["pool_bytes"] == per_block * shard_blocks(SHARDED, 2, 1)
    # Rank 3 was killed at block 2: the three others raised within seconds.
    assert "failed_at" in results[3] and "killed" not in results[3]
    assert_raised_in_time(results, 3, "rank ")


def test_layout_with_window_shards():
    layout = ParallelLayout(ulysses_degree=2, kv_shard_degree=3, cfg_degree=2)
    assert layout.world_size == 12 and layout.sequence_degree == 6
    assert layout.coordinates(7) == (1, 0, 1)  # 7 = (1 * 3 + 0) * 2 + 1
    assert layout.kv_shard_groups()[0] == [0, 2, 4]
    assert layout.cfg_groups()[0] == [0, 6]
    assert layout.sequence_groups() == [list(range(6)), list(range(6, 12))]
    every = sorted(r for group in layout.kv_shard_groups() for r in group)
    assert every == list(range(12))
    with pytest.raises(ValueError, match="kv_shard_degree"):
        ParallelLayout(kv_shard_degree=0)
