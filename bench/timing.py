"""Timing: ``triton.testing.do_bench`` on a GPU, a wall-clock loop on a CPU; the ceilings.

CPU figures time the Triton interpreter (numpy) or the kernels' plain-PyTorch path, not a GPU
kernel: they show the harness works and nothing about speed. Every row records which kind it
is (``figures``), and the tables never judge a goal on them.

On a CPU, interference from other processes only ever adds time, so a CPU row is judged by the
*minimum* of its timed calls (``min_ms``), taken with ``cpu_threads`` torch threads (default 1):
with two threads on two busy cores, torch's pool stalls for milliseconds waiting for a core
(a 128 KiB copy: 20 ms worst case with 2 threads, 0.01 ms with 1). A GPU row is judged by its
median. ``headline_ms`` in ``bench.results`` picks the right one for a row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

QUANTILES = (0.5, 0.2, 0.8)


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call: the median, the 20th and 80th percentiles, and the minimum."""

    p50_ms: float
    p20_ms: float
    p80_ms: float
    min_ms: float | None = None

    def headline(self, device: torch.device) -> float:
        """The figure a row is judged by: the median on a GPU, the minimum on a CPU."""
        return self.p50_ms if device.type == "cuda" or self.min_ms is None else self.min_ms


@dataclass(frozen=True)
class TimingSettings:
    """``rep_ms``/``warmup_ms`` feed ``do_bench`` on a GPU. On a CPU, up to ``cpu_reps`` timed
    calls with ``cpu_threads`` torch threads, stopping early (after ``CPU_MIN_REPS``) once
    ``cpu_budget_ms`` is spent: quick calls, the ones a stall distorts most, get every rep, and
    slow interpreter calls do not multiply the run's time."""

    rep_ms: int = 100
    warmup_ms: int = 25
    cpu_reps: int = 10
    cpu_threads: int = 1
    cpu_budget_ms: float = 300.0


# Timed calls a CPU case gets at least, whatever its budget (fewer only when cpu_reps is lower).
CPU_MIN_REPS = 3
# A ceiling gets this many times the case's calls on a CPU: its minimum must find a quiet moment
# on a shared machine, or the start and end ceilings disagree for no fault of the run; its
# calls take milliseconds.
CPU_CEILING_REPS_FACTOR = 3


def figures_kind(device: torch.device) -> str:
    """What this run's timings measure: ``"gpu"``, ``"cpu-interpreter"`` (Triton's
    interpreter) or ``"cpu-torch"`` (the kernels' plain-PyTorch path, interpreter off)."""
    if device.type == "cuda":
        return "gpu"
    return "cpu-interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "cpu-torch"


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` torch intra-op threads, then restore the previous count."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure(fn: Callable[[], object], device: torch.device, settings: TimingSettings) -> Timing:
    """Time ``fn`` (already warmed up by the caller's correctness check)."""
    if device.type == "cuda":
        import triton.testing

        p50, p20, p80 = triton.testing.do_bench(
            fn, warmup=settings.warmup_ms, rep=settings.rep_ms, quantiles=list(QUANTILES)
        )
        return Timing(p50, p20, p80)
    elapsed_ms = []
    with torch_threads(settings.cpu_threads):
        for _ in range(settings.cpu_reps):
            start = time.perf_counter()
            fn()
            elapsed_ms.append((time.perf_counter() - start) * 1e3)
            if len(elapsed_ms) >= CPU_MIN_REPS and sum(elapsed_ms) > settings.cpu_budget_ms:
                break
    p50, p20, p80 = np.quantile(elapsed_ms, QUANTILES)
    return Timing(float(p50), float(p20), float(p80), float(min(elapsed_ms)))


@dataclass(frozen=True)
class Ceiling:
    """A measured roof: ``tflops`` of a large matmul in one dtype, or ``gbps`` of a copy."""

    name: str
    dtype: str
    timing: Timing
    tflops: float | None = None
    gbps: float | None = None


def _ceiling_settings(settings: TimingSettings) -> TimingSettings:
    return dataclasses.replace(settings, cpu_reps=CPU_CEILING_REPS_FACTOR * settings.cpu_reps)


def matmul_ceiling(
    dtype_name: str, dtype: torch.dtype, device: torch.device, settings: TimingSettings
) -> Ceiling:
    """TFLOP/s of a square matmul: 8192 on a GPU, 256 on a CPU."""
    n = 8192 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    fn = lambda: torch.matmul(a, b)
    fn()
    timing = measure(fn, device, _ceiling_settings(settings))
    return Ceiling("matmul", dtype_name, timing, tflops=2 * n**3 / timing.headline(device) / 1e9)


def copy_ceiling(device: torch.device, settings: TimingSettings) -> Ceiling:
    """GB/s (bytes read plus written) of a device copy: 1 GiB on a GPU, 16 MiB on a CPU."""
    size = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.empty(size, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    fn = lambda: dst.copy_(src)
    fn()
    timing = measure(fn, device, _ceiling_settings(settings))
    return Ceiling("copy", "", timing, gbps=2 * size / timing.headline(device) / 1e6)
