"""Plots drawn from a results CSV: the speed-up against block size, then one PNG per kernel.

Kept apart from timing: ``python -m paged_video.bench plot out/sweep.csv --out out/`` redraws
any CSV.
The headline is ``speedup.png``: the fastest baseline's median over ours, per kernel, with the
1.0 line. Per kernel, attention is plotted in TFLOP/s, the copy kernels in GB/s; the bars span
the throughput at the 80th and 20th percentile times. A y axis whose values span more than a
decade is logarithmic.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from paged_video.bench.results import (
    ATTENTION_KERNELS,
    GEOMETRY_COLUMNS,
    QUANTIZED_GOALS,
    Row,
    read_rows,
)
from paged_video.bench.table import geometry_label, quantized_cases, ratio_cases, series_label

# Values spanning more than this factor get a log y axis.
LOG_SPAN = 10.0


def _scale_y(ax, values: Sequence[float]) -> None:
    """A log y axis when the positive ``values`` span more than ``LOG_SPAN``."""
    positive = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if positive and max(positive) / min(positive) > LOG_SPAN:
        ax.set_yscale("log")


def _block_axis(ax, blocks: Sequence[int]) -> None:
    ticks = sorted(set(blocks))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("block size (tokens)")
    ax.grid(alpha=0.3)


def _subtitle(rows: Sequence[Row]) -> str:
    first = rows[0]
    note = "" if first["figures"] == "gpu" else f"; {first['figures']} figures, not GPU speed"
    noisy = "" if first.get("noise") in (None, "", "steady") else "; NOISY RUN"
    return f"{first['device']}{note}{noisy}"


def draw_speedup(rows: Sequence[Row]) -> Figure:
    """The fastest baseline's median over ours against block size, one line per kernel and
    geometry, with the 1.0 line (above it, ours is faster); dashed, each quantized pool's
    speedup over our bf16 pool (its goal in the label)."""
    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for case in ratio_cases(rows):
        if case["speedup"] is not None:
            row = case["row"]
            label = f"{row['kernel']} ({geometry_label(row)})"
            lines[label].append((row["block_size"], case["speedup"]))
    dashed = set()
    for case in quantized_cases(rows):
        if case["speedup"] is not None:
            row = case["row"]
            goal = QUANTIZED_GOALS.get(str(row["provider"]))
            label = f"{row['provider']} / bf16 pool, goal {goal}x ({geometry_label(row)})"
            lines[label].append((row["block_size"], case["speedup"]))
            dashed.add(label)
    figure = Figure(figsize=(8.0, 4.8), layout="constrained")
    ax = figure.subplots()
    values = [1.0]
    for label, points in lines.items():
        points.sort()
        style = "--" if label in dashed else "-"
        ax.plot([b for b, _ in points], [v for _, v in points], style, marker="o", label=label)
        values += [v for _, v in points]
    ax.axhline(
        1.0, color="black", linestyle="--", linewidth=1, label="1.0: as fast as the baseline"
    )
    _block_axis(ax, [b for points in lines.values() for b, _ in points] or [1])
    _scale_y(ax, values)
    ax.set_ylabel("speed-up: fastest baseline time / ours")
    ax.legend(fontsize=8)
    figure.suptitle(f"speed-up against the fastest baseline ({_subtitle(rows)})", fontsize=10)
    return figure


def draw_kernel(rows: Sequence[Row], kernel: str) -> Figure:
    """One subplot per geometry, one line per provider (and tile), against block size."""
    metric, unit = ("tflops", "TFLOP/s") if kernel in ATTENTION_KERNELS else ("gbps", "GB/s")
    groups: dict[tuple[object, ...], list[Row]] = defaultdict(list)
    for row in rows:
        if row["kernel"] == kernel and row.get("role") != "best-of" and not row.get("skipped"):
            groups[tuple(row[c] for c in GEOMETRY_COLUMNS)].append(row)
    columns = min(3, len(groups))
    lines = math.ceil(len(groups) / columns)
    figure = Figure(figsize=(max(7.0, 5.5 * columns), 4.3 * lines), layout="constrained")
    axes = figure.subplots(lines, columns, squeeze=False).ravel()
    for ax, group in zip(axes, groups.values(), strict=False):
        series: dict[str, list[Row]] = defaultdict(list)
        for row in group:
            series[series_label(row)].append(row)
        for label, points in series.items():
            points.sort(key=lambda r: r["block_size"])
            x = [r["block_size"] for r in points]
            y = [r[metric] for r in points]
            slow = [r[metric] * r["p50_ms"] / r["p80_ms"] for r in points]
            fast = [r[metric] * r["p50_ms"] / r["p20_ms"] for r in points]
            # max(0, ...): the CSV rounds, so with one timed call the bars can come out -1e-9.
            errors = [[max(0.0, v - s) for v, s in zip(y, slow, strict=True)]]
            errors.append([max(0.0, f - v) for v, f in zip(y, fast, strict=True)])
            ax.errorbar(x, y, yerr=errors, marker="o", capsize=3, label=label)
        _block_axis(ax, [r["block_size"] for r in group])
        _scale_y(ax, [r[metric] for r in group])
        ax.set_ylabel(unit)
        ax.set_title(geometry_label(group[0]), fontsize=9)
        ax.legend(fontsize=8)
    for ax in axes[len(groups) :]:
        ax.set_visible(False)
    figure.suptitle(f"{kernel} ({_subtitle(rows)})", fontsize=11)
    return figure


def plot_rows(rows: Sequence[Row], out_dir: str | Path) -> list[Path]:
    """Write ``speedup.png`` (when any kernel has a baseline or a quantized pool) and
    ``<kernel>.png`` for every kernel in ``rows`` into ``out_dir``; returns the paths, the
    headline first."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kernels = dict.fromkeys(
        r["kernel"] for r in rows if r["kernel"] != "ceiling" and not r.get("skipped")
    )
    paths = []
    cases = [*ratio_cases(rows), *quantized_cases(rows)]
    if any(case["speedup"] is not None for case in cases):
        path = out_dir / "speedup.png"
        draw_speedup(rows).savefig(path, dpi=110)
        paths.append(path)
    for kernel in kernels:
        path = out_dir / f"{kernel}.png"
        draw_kernel(rows, kernel).savefig(path, dpi=110)
        paths.append(path)
    return paths


def plot_csv(csv_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Read a results CSV and write its plots."""
    return plot_rows(read_rows(csv_path), out_dir)
