"""Which baselines run, and why the others are skipped; the accuracy rule anchored on torch.

All on a CPU: cuDNN and Efficient SDPA are skipped with their reason, Flash (torch's CPU kernel)
runs and is repeated as ``sdpa-best``; a planted wrong result fails the check.
"""

from __future__ import annotations

import math

import pytest
import torch

from paged_video import reference
from paged_video.bench.cli import main
from paged_video.bench.providers import (
    PROVIDERS,
    SDPA_BACKENDS,
    Bench,
    Provider,
    forced_sdpa,
    pregathered,
    sdpa_unsupported,
)
from paged_video.bench.results import read_rows
from paged_video.bench.sweep import (
    WrongResultError,
    _best_sdpa_row,
    accuracy_limit,
    max_error,
    run_sweep,
    selected_providers,
)
from paged_video.bench.workload import Geometry, make_workload, oracle_attention
from tests.bench.rows import measured
from tests.bench.tiny import TINY, paged_config

CPU = torch.device("cpu")


def test_sdpa_best_names_the_three_forced_backends_and_flex_runs_last():
    names = [p.name for p in selected_providers(paged_config(providers=("sdpa-best",)), PROVIDERS)]
    assert names == list(SDPA_BACKENDS)
    everything = [p.name for p in selected_providers(paged_config(), PROVIDERS)]
    assert everything[-1] == "flex" and everything.index("triton") < everything.index("flex")
    assert everything.index("sdpa-flash") < everything.index("flex")


def test_cuda_only_backends_are_refused_on_a_cpu_with_a_reason():
    assert "CUDA only" in sdpa_unsupported("sdpa-cudnn", CPU)
    assert "CUDA only" in sdpa_unsupported("sdpa-efficient", CPU)
    assert sdpa_unsupported("sdpa-flash", CPU) is None
    assert sdpa_unsupported("sdpa-cudnn", torch.device("cuda")) is None  # tried, not assumed


def test_a_forced_backend_that_refuses_raises_with_torchs_reason():
    w = make_workload(TINY, 8)
    q, k, v = pregathered(w)
    with pytest.raises(RuntimeError, match="EFFICIENT_ATTENTION refused: "):
        forced_sdpa("sdpa-efficient")(q, k, v)  # no CPU kernel: torch refuses
    out = forced_sdpa("sdpa-flash")(q, k, v)
    assert out.shape == q.shape


def test_the_sweep_reports_each_backend_run_or_skipped(tmp_path, capsys):
    result = run_sweep(
        paged_config(providers=("triton", "sdpa-best", "flash_attn", "flex")),
        tmp_path / "sweep.csv",
        progress=False,
    )
    reasons = {s.provider: s.reason for s in result.skipped}
    assert set(reasons) == {"sdpa-cudnn", "sdpa-efficient", "flash_attn", "flex"}
    assert "CUDA only" in reasons["sdpa-cudnn"] and "CUDA only" in reasons["sdpa-efficient"]
    rows = {r["provider"]: r for r in read_rows(tmp_path / "sweep.csv") if r["kernel"] != "ceiling"}
    assert set(rows) == {"triton", "sdpa-flash", "sdpa-best"}
    assert rows["sdpa-flash"]["backend"] == "FLASH_ATTENTION"
    assert rows["sdpa-best"]["backend"] == "sdpa-flash"  # the one that ran, by name
    assert rows["sdpa-best"]["role"] == "best-of" and rows["triton"]["role"] == "ours"
    assert rows["sdpa-best"]["p50_ms"] == rows["sdpa-flash"]["p50_ms"]
    # The CSV has a row for each skip too, with its reason and no figures.
    skips = [r for r in read_rows(tmp_path / "sweep.csv", skipped=True) if r["skipped"]]
    assert {r["provider"]: r["skipped"] for r in skips} == reasons
    assert all(r["p50_ms"] is None and r["block_size"] == 8 and r["heads"] == 2 for r in skips)
    assert main(["table", str(tmp_path / "sweep.csv"), "--long"]) == 0
    assert f"skipped paged_attention/sdpa-cudnn (block sizes 8): {reasons['sdpa-cudnn']}" in (
        capsys.readouterr().out
    )


def test_sdpa_best_is_the_fastest_backend_of_the_case():
    rows = [
        measured("paged_attention", "triton", 16, 1.0, role="ours"),
        measured("paged_attention", "sdpa-cudnn", 16, 2.5),
        measured("paged_attention", "sdpa-flash", 16, 2.0),
        measured("paged_attention", "sdpa-efficient", 16, 3.0),
        measured("paged_attention", "flex", 16, 0.5),  # a baseline, but not an SDPA backend
    ]
    best = _best_sdpa_row(rows)
    assert (best["provider"], best["backend"], best["p50_ms"]) == ("sdpa-best", "sdpa-flash", 2.0)
    assert _best_sdpa_row(rows[:1]) is None


def test_with_no_backend_left_sdpa_best_is_skipped(tmp_path):
    cuda_only = [p for p in PROVIDERS if p.name in ("sdpa-cudnn", "sdpa-efficient")]
    result = run_sweep(paged_config(), tmp_path / "sweep.csv", providers=cuda_only, progress=False)
    reasons = {s.provider: s.reason for s in result.skipped}
    assert "no forced SDPA backend ran" in reasons["sdpa-best"]
    assert all(r["kernel"] == "ceiling" for r in result.rows)


def test_the_time_limit_skips_what_is_left_and_still_measures_the_end_ceilings(tmp_path):
    result = run_sweep(paged_config(time_limit_s=1e-9), tmp_path / "sweep.csv", progress=False)
    assert result.skipped and all(
        "time limit" in s.reason
        or "CUDA only" in s.reason
        or "GPU" in s.reason
        or "not installed" in s.reason
        or "no forced SDPA" in s.reason
        for s in result.skipped
    )
    assert any("time limit" in s.reason for s in result.skipped if s.provider == "triton")
    assert {r["phase"] for r in result.rows} == {"start", "end"}


# --- the accuracy rule --------------------------------------------------------------------


def test_the_limit_is_twice_torchs_error_plus_a_floor():
    assert accuracy_limit("paged_attention", "bf16", 3e-3) == pytest.approx(2 * 3e-3 + 4e-3)
    assert accuracy_limit("paged_attention", "fp32", 1e-7) == pytest.approx(2e-7 + 1e-5)
    assert accuracy_limit("write_slots", "bf16", None) == 0.0  # copies are exact
    with pytest.raises(ValueError, match="torch_error"):
        accuracy_limit("staged", "bf16", math.nan)


# The shipped key count (sink 9 + window 9 frames of 1560 = 28080 keys) with few queries, bf16.
LONG = Geometry(
    chunk_size=16,
    frames=2,
    sink_chunks=877,
    window_chunks=878,
    heads=2,
    kv_heads=1,
    head_dim=128,
    dtype="bf16",
)


def _attention_without(block: int | None):
    """A provider: exact attention (float64, rounded to bf16) over every key but one block's."""

    def build(workload, tile):
        keep = torch.ones(workload.geometry.kv_tokens, dtype=torch.bool)
        if block is not None:
            keep[block * workload.block_size : (block + 1) * workload.block_size] = False
        keys, values = workload.keys[0][keep], workload.values[0][keep]
        return Bench(lambda: reference.dense_attention(workload.q, keys, values).to(torch.bfloat16))

    return Provider("paged_attention", "planted", build)  # as if it were ours: a wrong one raises


@pytest.fixture(scope="module")
def long_errors():
    """Torch's bf16 error and a dropped block's error at the shipped key count."""
    w = make_workload(LONG, 16)
    expected = oracle_attention(w)
    dropped = _attention_without(0).build(w, None).run()
    from paged_video.bench.providers import torch_sdpa_output

    return max_error(torch_sdpa_output(w), expected), max_error(dropped, expected)


def test_dropping_one_block_of_28080_keys_fails_the_bf16_limit(long_errors):
    torch_error, dropped_error = long_errors
    assert 1e-3 < torch_error < 1e-2  # bf16-sized: torch itself is this far off
    assert dropped_error > accuracy_limit("paged_attention", "bf16", torch_error)
    assert dropped_error < 4e-2  # the old fixed bf16 tolerance would have let it through


def test_the_sweep_rejects_the_planted_result_and_accepts_the_right_one(tmp_path):
    config = paged_config(geometries=(LONG,), block_sizes=(16,), providers=("planted",))
    with pytest.raises(WrongResultError, match=r"planted .* disagrees .*torch SDPA's error"):
        run_sweep(config, tmp_path / "a.csv", providers=[_attention_without(0)], progress=False)
    result = run_sweep(
        config, tmp_path / "b.csv", providers=[_attention_without(None)], progress=False
    )
    (row,) = [r for r in result.rows if r["kernel"] != "ceiling"]
    assert 0 < row["max_error"] <= row["error_limit"]
    assert row["error_limit"] == pytest.approx(2 * row["torch_error"] + 4e-3)
