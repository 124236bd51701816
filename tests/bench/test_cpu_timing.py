"""CPU figures are timed as honestly as a shared machine allows and never judged as a speed:
one torch thread, the minimum of the calls, no ceiling or goal verdicts, no change called."""

from __future__ import annotations

import time

import torch

from paged_video.bench.compare import compare_rows, format_compare
from paged_video.bench.results import headline_ms, noise_verdict
from paged_video.bench.table import format_ratios
from paged_video.bench.timing import TimingSettings, measure
from tests.bench.rows import STEADY_CEILINGS, measured

CPU = {"figures": "cpu-interpreter", "device": "cpu x86_64"}


def _cpu(row: dict) -> dict:
    return {**row, **CPU}


def test_cpu_timing_runs_with_the_asked_threads_and_keeps_the_minimum():
    threads_seen = []
    before = torch.get_num_threads()
    settings = TimingSettings(cpu_reps=4, cpu_threads=1)
    timing = measure(
        lambda: threads_seen.append(torch.get_num_threads()), torch.device("cpu"), settings
    )
    assert threads_seen == [1, 1, 1, 1]
    assert torch.get_num_threads() == before  # restored
    assert timing.min_ms is not None and 0 <= timing.min_ms <= timing.p20_ms <= timing.p50_ms
    assert timing.headline(torch.device("cpu")) == timing.min_ms


def test_slow_cpu_calls_stop_at_three_once_the_budget_is_spent():
    calls = []
    slow = lambda: (calls.append(1), time.sleep(0.002))
    measure(slow, torch.device("cpu"), TimingSettings(cpu_reps=10, cpu_budget_ms=1.0))
    assert len(calls) == 3
    calls.clear()
    measure(
        lambda: calls.append(1), torch.device("cpu"), TimingSettings(cpu_reps=10)
    )  # quick: every rep
    assert len(calls) == 10


def test_a_cpu_row_is_judged_by_its_minimum_a_gpu_row_by_its_median():
    gpu = measured("paged_attention", "triton", 16, 2.0, role="ours", min_ms=1.0)
    assert headline_ms(gpu) == 2.0
    assert headline_ms(_cpu(gpu)) == 1.0
    assert headline_ms(_cpu({**gpu, "min_ms": None})) == 2.0  # a CSV from before min_ms


def test_no_ceiling_verdict_on_a_cpu_run():
    """Cache-resident CPU rows beat a 16 MiB copy: not noise. On a GPU it still is."""
    fast_copy = measured("write_slots", "torch", 64, 1.0, gbps=10_000.0)  # above 4000 GB/s
    gpu_rows = [*STEADY_CEILINGS, fast_copy]
    assert noise_verdict(gpu_rows).startswith("noisy: 1 rows above their ceiling")
    assert noise_verdict([_cpu(r) for r in gpu_rows]) == "steady"
    drifted = [*STEADY_CEILINGS[:3], {**STEADY_CEILINGS[3], "gbps": 100.0}, fast_copy]
    assert noise_verdict([_cpu(r) for r in drifted]).startswith("noisy: copy ceiling")


def test_no_goal_verdict_on_cpu_rows():
    rows = [
        *STEADY_CEILINGS,
        measured("paged_attention", "triton", 16, 4.0, role="ours"),
        measured("paged_attention", "sdpa-flash", 16, 1.0),  # 0.25x
        measured("paged_attention", "triton-int8", 16, 8.0, role="quantized"),  # 0.5x
    ]
    gpu = format_ratios(rows, goal=True)
    assert "BELOW 1.0x" in gpu and "BELOW 1.30x" in gpu
    cpu = format_ratios([_cpu(r) for r in rows], goal=True)
    assert "BELOW" not in cpu
    assert cpu.count("not a speed") >= 4  # the note, both rows, both summaries
    assert "goals: not judged (cpu-interpreter figures are not a speed)" in cpu
    assert "quantized goals: not judged" in cpu


def test_compare_calls_no_change_between_cpu_or_noisy_runs():
    old = [measured("paged_attention", "triton", 16, 2.0, role="ours", spread=0.01)]
    new = [measured("paged_attention", "triton", 16, 1.0, role="ours", spread=0.01)]
    assert [v for *_, v in compare_rows(old, new)] == ["faster"]
    cpu_old, cpu_new = [_cpu(r) for r in old], [_cpu(r) for r in new]
    assert [v for *_, v in compare_rows(cpu_old, cpu_new)] == ["not called"]
    printed = format_compare(cpu_old, cpu_new)
    assert "no change called: the old run has cpu-interpreter figures" in printed
    assert "faster" not in printed
    noisy = [{**r, "noise": "noisy: copy ceiling 4000 at start, 3000 at end"} for r in new]
    assert [v for *_, v in compare_rows(old, noisy)] == ["not called"]
    assert "the new run was marked noisy" in format_compare(old, noisy)
