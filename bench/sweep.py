"""The sweep: every (geometry, block size, kernel, provider, tile) is checked, then timed.

A provider whose result disagrees with the oracle raises ``WrongResultError`` before anything is
timed, so a wrong kernel never produces a figure or a CSV row. Rows are written as they are
measured; the ceilings (a large matmul per dtype, a large copy) come first.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from bench.providers import PROVIDERS, Output, Provider, Tile
from bench.results import ATTENTION_KERNELS, KERNELS, CsvWriter, Row, provenance
from bench.timing import (
    Ceiling,
    Timing,
    TimingSettings,
    copy_ceiling,
    figures_kind,
    matmul_ceiling,
    measure,
)
from bench.workload import (
    DTYPES,
    Geometry,
    Workload,
    make_workload,
    oracle_attention,
    oracle_pools,
    oracle_stage,
)

# Largest error allowed, relative to the oracle's largest magnitude; the copy kernels are exact.
ATTENTION_TOLERANCE = {"fp32": 2e-3, "fp16": 1e-2, "bf16": 4e-2}


class WrongResultError(AssertionError):
    """A provider's result disagrees with the oracle: it must not be timed."""


@dataclass(frozen=True)
class SweepConfig:
    """What to run. ``providers`` names the providers to keep (None: all that apply)."""

    geometries: tuple[Geometry, ...]
    block_sizes: tuple[int, ...]
    kernels: tuple[str, ...] = KERNELS
    providers: tuple[str, ...] | None = None
    tiles: tuple[Tile | None, ...] = (None,)
    device: str = "cpu"
    seed: int = 0
    timing: TimingSettings = field(default_factory=TimingSettings)


@dataclass(frozen=True)
class Skip:
    kernel: str
    provider: str
    block_size: int
    reason: str


@dataclass
class SweepResult:
    rows: list[Row]
    skipped: list[Skip]
    csv_path: Path


def tolerance(kernel: str, dtype: str) -> float:
    return ATTENTION_TOLERANCE[dtype] if kernel in ATTENTION_KERNELS else 0.0


def max_error(actual: Output, expected: Output) -> float:
    """Largest ``|actual - expected|`` over ``max |expected|``; inf for NaN or a shape mismatch."""
    actual_parts = actual if isinstance(actual, tuple) else (actual,)
    expected_parts = expected if isinstance(expected, tuple) else (expected,)
    if len(actual_parts) != len(expected_parts):
        return math.inf
    worst = 0.0
    for got, want in zip(actual_parts, expected_parts, strict=True):
        if got.shape != want.shape:
            return math.inf
        want64 = want.to(torch.float64)
        scale = max(float(want64.abs().max()), 1e-30)
        error = float((got.to(torch.float64) - want64).abs().max()) / scale
        if not math.isfinite(error):
            return math.inf
        worst = max(worst, error)
    return worst


def bytes_moved(kernel: str, workload: Workload) -> int:
    """Bytes a kernel must read and write at least: attention reads q, K, V and writes out;
    staging reads and writes every visible block; a slot write reads and writes the chunk."""
    g = workload.geometry
    item = torch.empty((), dtype=g.torch_dtype).element_size()
    kv_token = g.kv_heads * g.head_dim * item
    attention = 2 * g.batch * g.q_tokens * g.heads * g.head_dim * item
    attention += 2 * g.batch * g.kv_tokens * kv_token
    staging = 2 * 2 * g.batch * workload.staged_tokens * kv_token
    chunk_write = 2 * 2 * g.batch * g.q_tokens * kv_token
    return {
        "paged_attention": attention,
        "staged": staging + attention,
        "gather_blocks": staging,
        "write_slots": chunk_write,
    }[kernel]


class _Oracles:
    """Expected results; the attention oracle serves every block size of one geometry."""

    def __init__(self) -> None:
        self._cache: dict[tuple[object, ...], Output] = {}

    def expected(self, kernel: str, workload: Workload) -> Output:
        geometry, block_size = workload.geometry, workload.block_size
        attention = kernel in ATTENTION_KERNELS
        key = ("attention", geometry) if attention else (kernel, geometry, block_size)
        if key not in self._cache:
            self._cache = {
                old: value
                for old, value in self._cache.items()
                if old[1] == geometry and (old[0] == "attention" or old[2] == block_size)
            }
            if attention:
                self._cache[key] = oracle_attention(workload)
            elif kernel == "gather_blocks":
                self._cache[key] = oracle_stage(workload)
            else:
                self._cache[key] = oracle_pools(workload)
        return self._cache[key]


def selected_providers(config: SweepConfig, providers: Sequence[Provider]) -> list[Provider]:
    return [
        p
        for p in providers
        if p.kernel in config.kernels and (config.providers is None or p.name in config.providers)
    ]


def _tiles_for(provider: Provider, config: SweepConfig) -> tuple[Tile | None, ...]:
    return config.tiles if provider.tunable else (None,)


def _check_then_time(
    provider: Provider,
    tile: Tile | None,
    workload: Workload,
    expected: Output,
    device: torch.device,
    settings: TimingSettings,
) -> tuple[Timing, float] | str:
    """``(timing, max_error)``, or why a baseline could not run. Raises on a wrong result."""
    try:
        bench = provider.build(workload, tile)
        output = bench.to_reference_layout(bench.run())
    except Exception as error:
        if not provider.baseline:
            raise
        message = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        return f"failed: {type(error).__name__}: {message}"
    error = max_error(output, expected)
    limit = tolerance(provider.kernel, workload.geometry.dtype)
    if not error <= limit:
        g = workload.geometry
        raise WrongResultError(
            f"{provider.kernel}/{provider.name} (block_size={workload.block_size}, tile={tile}, "
            f"{g}) disagrees with the oracle: max error {error:.3g} > tolerance {limit:.3g}; "
            "not timed"
        )
    return measure(bench.run, device, settings), error


def _ceiling_row(ceiling: Ceiling, shared: Row) -> Row:
    return {
        "kernel": "ceiling",
        "provider": ceiling.name,
        "dtype": ceiling.dtype,
        "p50_ms": ceiling.timing.p50_ms,
        "p20_ms": ceiling.timing.p20_ms,
        "p80_ms": ceiling.timing.p80_ms,
        "tflops": ceiling.tflops,
        "gbps": ceiling.gbps,
        **shared,
    }


def _measured_row(
    provider: Provider,
    tile: Tile | None,
    workload: Workload,
    timing: Timing,
    error: float,
    roofs: tuple[dict[str, float], float],
    shared: Row,
) -> Row:
    g = workload.geometry
    matmul_tflops, copy_gbps = roofs
    seconds = timing.p50_ms / 1e3
    tflops = g.attention_flops() / seconds / 1e12 if provider.kernel in ATTENTION_KERNELS else None
    gbps = bytes_moved(provider.kernel, workload) / seconds / 1e9
    return {
        "kernel": provider.kernel,
        "provider": provider.name,
        "block_size": workload.block_size,
        "tile": str(tile) if tile else ("auto" if provider.tunable else ""),
        "chunk_size": g.chunk_size,
        "frames": g.frames,
        "sink_chunks": g.sink_chunks,
        "window_chunks": g.window_chunks,
        "batch": g.batch,
        "heads": g.heads,
        "kv_heads": g.kv_heads,
        "head_dim": g.head_dim,
        "dtype": g.dtype,
        "q_tokens": g.q_tokens,
        "kv_tokens": g.kv_tokens,
        "p50_ms": timing.p50_ms,
        "p20_ms": timing.p20_ms,
        "p80_ms": timing.p80_ms,
        "tflops": tflops,
        "gbps": gbps,
        "tflops_vs_matmul": None if tflops is None else tflops / matmul_tflops[g.dtype],
        "gbps_vs_copy": gbps / copy_gbps,
        "max_error": error,
        **shared,
    }


def run_sweep(
    config: SweepConfig,
    csv_path: str | Path,
    *,
    providers: Sequence[Provider] = PROVIDERS,
    progress: bool = True,
) -> SweepResult:
    """Run the sweep, writing the long-format CSV to ``csv_path`` as rows are measured."""
    device = torch.device(config.device)
    shared = provenance(device, figures_kind(device))
    chosen = selected_providers(config, providers)
    csv_path = Path(csv_path)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    result = SweepResult(rows=[], skipped=[], csv_path=csv_path)
    with open(csv_path, "w", newline="") as stream:
        writer = CsvWriter(stream)

        def record(row: Row) -> None:
            writer.write(row)
            result.rows.append(row)

        dtypes = dict.fromkeys(g.dtype for g in config.geometries)
        ceilings = [matmul_ceiling(d, DTYPES[d], device, config.timing) for d in dtypes]
        ceilings.append(copy_ceiling(device, config.timing))
        for ceiling in ceilings:
            record(_ceiling_row(ceiling, shared))
        roofs = ({c.dtype: c.tflops for c in ceilings if c.tflops}, ceilings[-1].gbps or math.nan)

        oracles = _Oracles()
        runs_per_case = sum(len(_tiles_for(p, config)) for p in chosen)
        cases = list(itertools.product(config.geometries, config.block_sizes))
        with tqdm(total=len(cases) * runs_per_case, unit="run", disable=not progress) as bar:
            for geometry, block_size in cases:
                workload = make_workload(geometry, block_size, device=device, seed=config.seed)
                for provider in chosen:
                    for tile in _tiles_for(provider, config):
                        bar.set_postfix_str(f"{provider.kernel}/{provider.name} B={block_size}")
                        reason = provider.unsupported(workload)
                        if reason is None:
                            expected = oracles.expected(provider.kernel, workload)
                            outcome = _check_then_time(
                                provider, tile, workload, expected, device, config.timing
                            )
                            if isinstance(outcome, str):
                                reason = outcome
                            else:
                                record(
                                    _measured_row(provider, tile, workload, *outcome, roofs, shared)
                                )
                        if reason is not None:
                            skip = Skip(provider.kernel, provider.name, block_size, reason)
                            result.skipped.append(skip)
                        bar.update()
                del workload  # free this case's tensors before the next one is allocated
    return result
