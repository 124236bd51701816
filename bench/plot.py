"""Plots drawn from a results CSV: one PNG per kernel, throughput against block size.

Kept apart from timing: ``python -m bench plot out/sweep.csv --out out/`` redraws any CSV.
Attention kernels are plotted in TFLOP/s, the copy kernels in GB/s; the bars span the
throughput at the 80th and 20th percentile times.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from bench.results import ATTENTION_KERNELS, GEOMETRY_COLUMNS, Row, read_rows
from bench.table import geometry_label, series_label


def draw_kernel(rows: Sequence[Row], kernel: str) -> Figure:
    """One subplot per geometry, one line per provider (and tile), against block size."""
    metric, unit = ("tflops", "TFLOP/s") if kernel in ATTENTION_KERNELS else ("gbps", "GB/s")
    groups: dict[tuple[object, ...], list[Row]] = defaultdict(list)
    for row in rows:
        if row["kernel"] == kernel:
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
        ticks = sorted({r["block_size"] for r in group})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel(unit)
        ax.set_title(geometry_label(group[0]), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[len(groups) :]:
        ax.set_visible(False)
    first = next(iter(groups.values()))[0]
    note = "" if first["figures"] == "gpu" else f"\n{first['figures']} figures, not GPU speed"
    figure.suptitle(f"{kernel} on {first['device']}{note}", fontsize=11)
    return figure


def plot_rows(rows: Sequence[Row], out_dir: str | Path) -> list[Path]:
    """Write ``<kernel>.png`` into ``out_dir`` for every kernel in ``rows``; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kernels = dict.fromkeys(r["kernel"] for r in rows if r["kernel"] != "ceiling")
    paths = []
    for kernel in kernels:
        path = out_dir / f"{kernel}.png"
        draw_kernel(rows, kernel).savefig(path, dpi=110)
        paths.append(path)
    return paths


def plot_csv(csv_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Read a results CSV and write its plots."""
    return plot_rows(read_rows(csv_path), out_dir)
