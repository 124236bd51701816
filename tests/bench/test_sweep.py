"""The sweep harness on a CPU: it runs, its CSV has every column, wrong providers are refused."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from paged_video import reference
from paged_video.bench.providers import PROVIDERS, QUANTIZED_PROVIDERS, Bench, Provider
from paged_video.bench.results import COLUMNS, KERNELS, read_rows
from paged_video.bench.sweep import (
    SweepConfig,
    WrongResultError,
    max_error,
    rounding_allowance,
    run_sweep,
)
from paged_video.bench.timing import TimingSettings, figures_kind, measure
from paged_video.bench.workload import Geometry
from tests.bench.tiny import QUICK, TINY


def tiny_config(**overrides: object) -> SweepConfig:
    settings = dict(geometries=(TINY,), block_sizes=(8, 5), timing=QUICK, device="cpu")
    settings.update(overrides)
    return SweepConfig(**settings)


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    csv_path = tmp_path_factory.mktemp("sweep") / "sweep.csv"
    return run_sweep(tiny_config(), csv_path, progress=False)


def test_csv_has_every_column_and_a_checked_row_per_kernel(tiny_sweep):
    with open(tiny_sweep.csv_path, newline="") as stream:
        assert tuple(csv.DictReader(stream).fieldnames) == COLUMNS
    rows = read_rows(tiny_sweep.csv_path)
    assert len(rows) == len(tiny_sweep.rows)
    measured = [r for r in rows if r["kernel"] != "ceiling"]
    assert {(r["kernel"], r["block_size"]) for r in measured if r["provider"] == "triton"} == {
        (kernel, block) for kernel in KERNELS for block in (8, 5)
    }
    for row in measured:
        assert row["p20_ms"] <= row["p50_ms"] <= row["p80_ms"], row
        assert row["gbps"] > 0 and row["gbps_vs_copy"] > 0
        if row["role"] != "bound":
            assert row["max_error"] <= row["error_limit"]
        if row["kernel"] in ("paged_attention", "staged") and row["role"] != "oracle":
            allowance = rounding_allowance(QUANTIZED_PROVIDERS.get(row["provider"]))
            assert 0 < row["torch_error"] < row["error_limit"] - allowance < 1e-4  # fp32: close
        assert row["noise"]  # the run ended, so its verdict is in every row
        assert (row["tflops"] is not None) == (row["kernel"] in ("paged_attention", "staged"))
        assert row["q_tokens"] == 8 and row["kv_tokens"] == 24 and row["kv_heads"] == 1
        assert row["figures"] == figures_kind(torch.device("cpu"))  # interpreter or torch path
        assert row["torch"] == torch.__version__ and row["commit"] and row["timestamp"]
    ceilings = {r["provider"]: r for r in rows if r["kernel"] == "ceiling"}
    assert ceilings["matmul"]["tflops"] > 0 and ceilings["copy"]["gbps"] > 0


def test_baselines_run_beside_the_kernels(tiny_sweep):
    providers = {(r["kernel"], r["provider"]) for r in tiny_sweep.rows}
    for expected in [
        ("paged_attention", "reference"),
        ("paged_attention", "sdpa-flash"),
        ("paged_attention", "sdpa-best"),
        ("paged_attention", "sdpa+gather"),
        ("staged", "triton+sdpa"),
        ("gather_blocks", "torch"),
        ("gather_blocks", "copy"),
        ("write_slots", "torch"),
        ("write_slots", "copy"),
    ]:
        assert expected in providers
    skipped = {(s.kernel, s.provider) for s in tiny_sweep.skipped}
    assert ("paged_attention", "flex") in skipped  # compiled flex is GPU-only


def _wrong_attention(workload, tile):
    """Drops each sequence's last key: close to right, but wrong."""
    w = workload
    return Bench(
        lambda: reference.paged_attention(
            w.q,
            w.k_cache,
            w.v_cache,
            w.block_table,
            w.cu_seqlens_q,
            w.seq_lens_k - 1,
            max_seqlen_q=w.geometry.q_tokens,
        )
    )


def _wrong_write(workload, tile):
    """Writes every token but the last."""
    g = workload.geometry
    k_pool = workload.k_cache.reshape(-1, g.kv_heads, g.head_dim).clone()
    v_pool = workload.v_cache.reshape(-1, g.kv_heads, g.head_dim).clone()
    slots = workload.write_slot_mapping[:-1]

    def run():
        k_pool[slots] = workload.new_keys[:-1]
        v_pool[slots] = workload.new_values[:-1]
        return k_pool, v_pool

    return Bench(run)


@pytest.mark.parametrize(
    "wrong",
    [
        Provider("paged_attention", "wrong", _wrong_attention),
        Provider("write_slots", "wrong", _wrong_write),
    ],
    ids=lambda p: p.kernel,
)
def test_a_wrong_provider_is_never_timed_the_rest_runs_and_the_sweep_raises(tmp_path, wrong):
    csv_path = tmp_path / "sweep.csv"
    config = tiny_config(kernels=(wrong.kernel,), block_sizes=(8, 5))
    with pytest.raises(WrongResultError, match=f"{wrong.kernel}/wrong") as raised:
        run_sweep(config, csv_path, providers=[wrong, *PROVIDERS], progress=False)
    _assert_skipped_at_blocks_8_and_5_and_the_rest_ran(csv_path, "wrong", "WRONG RESULT")
    assert raised.value.result is not None and raised.value.result.csv_path == csv_path


def _assert_skipped_at_blocks_8_and_5_and_the_rest_ran(csv_path, provider: str, reason: str):
    rows = read_rows(csv_path, skipped=True)
    skipped = [r for r in rows if r["provider"] == provider]
    # One skipped row per block size, naming the error; never a figure.
    assert [r["block_size"] for r in skipped] == [8, 5]
    assert all(r["skipped"].startswith(reason) and r["p50_ms"] is None for r in skipped)
    # The right runs after it (at both block sizes) and the end ceilings were still measured.
    timed = {r["block_size"] for r in rows if r["provider"] == "triton" and r["p50_ms"]}
    assert timed == {8, 5}
    assert [r for r in rows if r["kernel"] == "ceiling" and r["phase"] == "end"]


def test_a_wrong_baseline_is_skipped_with_its_error_and_not_timed(tmp_path):
    wrong = Provider("paged_attention", "wrong", _wrong_attention, role="baseline")
    config = tiny_config(kernels=("paged_attention",), block_sizes=(8,))
    result = run_sweep(
        config, tmp_path / "sweep.csv", providers=[*PROVIDERS, wrong], progress=False
    )
    (reason,) = [s.reason for s in result.skipped if s.provider == "wrong"]
    assert reason.startswith("wrong result: max error ") and "not timed" in reason
    assert not [r for r in result.rows if r["provider"] == "wrong"]
    assert [r for r in result.rows if r["provider"] == "triton"]


def test_a_failing_baseline_is_skipped_and_a_failing_kernel_fails_the_sweep_at_its_end(tmp_path):
    def broken(workload, tile):
        raise RuntimeError("no such backend")

    baseline = Provider("gather_blocks", "broken", broken, role="baseline")
    config = tiny_config(kernels=("gather_blocks",), block_sizes=(8,))
    result = run_sweep(config, tmp_path / "a.csv", providers=[baseline], progress=False)
    assert [s.reason for s in result.skipped] == ["failed: RuntimeError: no such backend"]
    assert [(r["kernel"], r["phase"]) for r in result.rows] == [
        ("ceiling", "start"),
        ("ceiling", "start"),
        ("ceiling", "end"),
        ("ceiling", "end"),
    ]

    # Ours: a skipped row naming the error, the other runs and the end ceilings still measured,
    # and the sweep fails at its end.
    ours = Provider("gather_blocks", "broken", broken)
    config = tiny_config(kernels=("gather_blocks",), block_sizes=(8, 5))
    csv_path = tmp_path / "b.csv"
    with pytest.raises(WrongResultError, match=r"gather_blocks/broken .*RuntimeError: no such"):
        run_sweep(config, csv_path, providers=[ours, *PROVIDERS], progress=False)
    _assert_skipped_at_blocks_8_and_5_and_the_rest_ran(csv_path, "broken", "FAILED")


def test_provider_filter_keeps_only_the_named_providers(tmp_path):
    config = tiny_config(kernels=("gather_blocks", "write_slots"), providers=("torch",))
    result = run_sweep(config, tmp_path / "sweep.csv", progress=False)
    measured = [r for r in result.rows if r["kernel"] != "ceiling"]
    assert {r["provider"] for r in measured} == {"torch"}
    assert {r["kernel"] for r in measured} == {"gather_blocks", "write_slots"}


def test_tiles_are_swept_for_the_triton_attention_only(tmp_path):
    from paged_video.bench.providers import Tile

    config = tiny_config(
        kernels=("paged_attention",),
        providers=("triton", "sdpa-flash"),
        block_sizes=(16,),
        tiles=(None, Tile(16, 16)),
    )
    result = run_sweep(config, tmp_path / "sweep.csv", progress=False)
    tiles = sorted((r["provider"], r["tile"]) for r in result.rows if r["kernel"] != "ceiling")
    assert tiles == [("sdpa-best", ""), ("sdpa-flash", ""), ("triton", "16x16"), ("triton", "auto")]


def test_max_error_flags_nan_shape_and_value_differences():
    want = torch.tensor([1.0, -2.0, 4.0])
    assert max_error(want.clone(), want) == 0.0
    assert max_error(want + torch.tensor([0.0, 0.0, 0.4]), want) == pytest.approx(0.1)
    assert max_error(torch.tensor([1.0, math.nan, 4.0]), want) == math.inf
    assert max_error(want[:2], want) == math.inf
    assert max_error((want, want), (want, want + 1)) == pytest.approx(1 / 5)


def test_cpu_timing_reports_ordered_quantiles():
    calls = []
    timing = measure(lambda: calls.append(1), torch.device("cpu"), TimingSettings(cpu_reps=5))
    assert len(calls) == 5
    assert 0 <= timing.p20_ms <= timing.p50_ms <= timing.p80_ms


def test_a_batch_of_two_rows_with_gqa_checks_out_for_every_kernel(tmp_path):
    two_rows = Geometry(
        chunk_size=6,
        frames=2,
        sink_chunks=1,
        window_chunks=2,
        heads=4,
        kv_heads=2,
        head_dim=8,
        dtype="fp32",
        batch=2,
    )
    config = tiny_config(
        geometries=(two_rows,), block_sizes=(5,), providers=("triton", "sdpa-flash")
    )
    result = run_sweep(config, tmp_path / "sweep.csv", progress=False)
    measured = {(r["kernel"], r["provider"]) for r in result.rows if r["kernel"] != "ceiling"}
    assert {k for k, p in measured if p == "triton"} == set(KERNELS)
    assert all(r["batch"] == 2 for r in result.rows if r["kernel"] != "ceiling")


def test_figures_say_what_was_timed(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert figures_kind(torch.device("cpu")) == "cpu-interpreter"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert figures_kind(torch.device("cpu")) == "cpu-torch"
    assert figures_kind(torch.device("cuda")) == "gpu"
