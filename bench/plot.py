"""Plots drawn from a results CSV: the speed-up against block size, then one PNG per kernel.

Kept apart from timing: ``python -m paged_video.bench plot out/sweep.csv --out out/`` redraws
any CSV.
The headline is ``speedup.png``: one axis per ratio, each with its 1.0 line. The first is the
fastest baseline's time over ours, per kernel; the second (when the run has quantized pools) is
our unquantized pool's time over each quantized pool's, with its goal. Each line's legend
entry gives its ratio at the shipped block sizes (16 and 1560) that the run measured (a title
would run off the figure with many providers); the figure's title gives the geometry once.
Per kernel, attention is plotted in TFLOP/s, the copy kernels in GB/s; the error bars span the
throughput at the 80th and 20th percentile times (on a CPU, where the minimum is the figure,
they reach down only), and the y label says so. A y axis whose values span more than a
decade is logarithmic. Legends sit outside the axes, so no line hides behind one.
"""

from __future__ import annotations

import math
import textwrap
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from paged_video.bench.extras import require
from paged_video.bench.results import (
    ATTENTION_KERNELS,
    GEOMETRY_COLUMNS,
    QUANTIZED_GOALS,
    Row,
    headline_ms,
    is_gpu_row,
    read_rows,
    sig3,
)
from paged_video.bench.table import geometry_label, quantized_cases, ratio_cases, series_label

if TYPE_CHECKING:  # matplotlib is the bench extra's: imported where a figure is drawn
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# Values spanning more than this factor get a log y axis.
LOG_SPAN = 10.0
# The block sizes the shipped model runs (16: the default; 1560: one frame per block); the
# headline ratio is read at those the run measured.
SHIPPED_BLOCK_SIZES = (16, 1560)
# Entries per legend column (a 3.6-inch axis holds about this many at 8 points).
LEGEND_ROWS = 12
# Height of one legend entry at 8 points, in inches.
LEGEND_ENTRY_INCHES = 0.19
# Characters per legend line before an entry wraps.
LEGEND_WIDTH = 48


def scale_y(ax: Axes, values: Sequence[float]) -> None:
    """A log y axis when the positive ``values`` span more than ``LOG_SPAN``."""
    positive = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if positive and max(positive) / min(positive) > LOG_SPAN:
        ax.set_yscale("log")


def block_axis(ax: Axes, blocks: Sequence[int]) -> None:
    ticks = sorted(set(blocks))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("block size (tokens)")
    ax.grid(alpha=0.3)


def legend_outside(ax: Axes, rows: int = 0) -> None:
    """The axis's legend beside it, long entries wrapped and more than ``rows`` (default
    ``LEGEND_ROWS``) in columns, so the constrained layout can keep it on the figure."""
    handles, labels = ax.get_legend_handles_labels()
    entries = len(labels)
    ax.legend(
        handles,
        [textwrap.fill(label, LEGEND_WIDTH, subsequent_indent="  ") for label in labels],
        fontsize=8,
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        borderaxespad=0.0,
        ncols=max(1, math.ceil(entries / (rows or LEGEND_ROWS))),
    )


def _run_line(rows: Sequence[Row]) -> str:
    """The device and what its figures are: one line for a figure's title."""
    first = rows[0]
    note = "" if is_gpu_row(first) else f"; {first['figures']} figures: CPU, not a GPU speed"
    noisy = "" if first.get("noise") in (None, "", "steady") else "; NOISY RUN"
    return f"{first['device']}{note}{noisy}"


def _geometries(rows: Sequence[Row]) -> list[str]:
    return list(dict.fromkeys(geometry_label(r) for r in rows))


def _series_geometry(row: Row, several: bool) -> str:
    """A line's geometry, only when the figure has several (else the title gives it once)."""
    return f" ({geometry_label(row)})" if several else ""


def _headline(points: list[tuple[int, float]]) -> str:
    """``1.52x at B=16, 0.98x at B=1560``: one line's ratios at the shipped block sizes the run
    measured; empty when it measured none."""
    return ", ".join(f"{sig3(v)}x at B={b}" for b, v in sorted(points) if b in SHIPPED_BLOCK_SIZES)


def _ratio_axis(
    ax: Axes,
    lines: dict[str, list[tuple[int, float]]],
    ylabel: str,
    one_label: str,
    goals: dict[str, float] | None = None,
) -> None:
    """One ratio on one axis: a line per label, the 1.0 line, and a dotted line per goal."""
    values = [1.0]
    for label, points in lines.items():
        points.sort()
        headline = _headline(points)
        named = f"{label}: {headline}" if headline else label
        ax.plot([b for b, _ in points], [v for _, v in points], marker="o", label=named)
        values += [v for _, v in points]
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label=one_label)
    by_goal: dict[float, list[str]] = defaultdict(list)
    for label, goal in (goals or {}).items():
        by_goal[goal].append(label.split(" (")[0])
    for goal, labels in sorted(by_goal.items()):
        ax.axhline(
            goal,
            color="grey",
            linestyle=":",
            linewidth=1.5,
            label=f"goal {sig3(goal)}x: " + ", ".join(labels),
        )
        values.append(goal)
    block_axis(ax, [b for points in lines.values() for b, _ in points] or [1])
    scale_y(ax, values)
    ax.set_ylabel(ylabel)
    # One legend column: the figure grows to hold it (``draw_speedup``), never wider than 9".
    legend_outside(ax, rows=len(ax.get_legend_handles_labels()[1]))


def _legend_inches(ax: Axes) -> float:
    """The height an axis needs beside its legend: its wrapped lines plus the axis' margins."""
    legend = ax.get_legend()
    lines = sum(text.get_text().count("\n") + 1 for text in legend.get_texts()) if legend else 0
    return max(3.6, LEGEND_ENTRY_INCHES * lines + 1.2)


def draw_speedup(rows: Sequence[Row]) -> Figure:
    """One axis per ratio against block size, each with its 1.0 line: the fastest baseline's
    time over ours (a line per kernel), then our unquantized pool's time over each quantized
    pool's (dotted: the goals). Each line's legend entry gives its ratio at the shipped block
    sizes; the figure's title gives the geometry once, the device, and whether the figures are
    a speed."""
    baseline: dict[str, list[tuple[int, float]]] = defaultdict(list)
    cases = [c for c in ratio_cases(rows) if c["speedup"] is not None]
    several = len(_geometries([c["row"] for c in cases])) > 1
    for case in cases:
        row = case["row"]
        label = f"{row['kernel']}{_series_geometry(row, several)}"
        baseline[label].append((row["block_size"], case["speedup"]))
    quantized: dict[str, list[tuple[int, float]]] = defaultdict(list)
    goals: dict[str, float] = {}
    q_cases = [c for c in quantized_cases(rows) if c["speedup"] is not None]
    q_several = len(_geometries([c["row"] for c in q_cases])) > 1
    for case in q_cases:
        row = case["row"]
        label = f"{row['provider']}{_series_geometry(row, q_several)}"
        quantized[label].append((row["block_size"], case["speedup"]))
        if str(row["provider"]) in QUANTIZED_GOALS:
            goals[label] = QUANTIZED_GOALS[str(row["provider"])]
    panels = [p for p in (baseline, quantized) if p]
    figure = new_figure(figsize=(9.0, 3.6 * max(1, len(panels)) + 0.6), layout="constrained")
    axes = iter(figure.subplots(max(1, len(panels)), 1, squeeze=False).ravel())
    if baseline:
        ax = next(axes)
        _ratio_axis(ax, baseline, "fastest baseline time / ours", "1.0: as fast as the baseline")
        ax.set_title("ours against the fastest baseline", fontsize=9)
    if quantized:
        ax = next(axes)
        dtype = q_cases[0]["row"]["dtype"]
        _ratio_axis(
            ax,
            quantized,
            f"our {dtype} pool time / quantized pool's",
            f"1.0: as fast as our {dtype} pool",
            goals,
        )
        ax.set_title(f"quantized pools against our {dtype} pool", fontsize=9)
    panel_axes = figure.axes[: len(panels)]
    figure.set_size_inches(9.0, sum(_legend_inches(ax) for ax in panel_axes) + 0.6)
    measured = [c["row"] for c in (*cases, *q_cases)] or list(rows)
    geometry = "; ".join(_geometries(measured)) if not (several or q_several) else ""
    figure.suptitle(
        f"speed-up at each block size{': ' + geometry if geometry else ''}\n{_run_line(rows)}",
        fontsize=9,
    )
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
    # Every provider (and tile) a line in one legend column: the axis grows to hold them.
    entries = max(len({series_label(row) for row in group}) for group in groups.values())
    height = max(4.3, LEGEND_ENTRY_INCHES * entries + 1.2)
    figure = new_figure(figsize=(max(8.0, 9.0 * columns), height * lines), layout="constrained")
    axes = figure.subplots(lines, columns, squeeze=False).ravel()
    for ax, group in zip(axes, groups.values(), strict=False):
        series: dict[str, list[Row]] = defaultdict(list)
        for row in group:
            series[series_label(row)].append(row)
        for label, points in series.items():
            points.sort(key=lambda r: r["block_size"])
            x = [r["block_size"] for r in points]
            y = [r[metric] for r in points]
            slow = [r[metric] * headline_ms(r) / r["p80_ms"] for r in points]
            fast = [r[metric] * headline_ms(r) / r["p20_ms"] for r in points]
            # max(0, ...): the CSV rounds, so with one timed call the bars can come out -1e-9;
            # on a CPU the headline is the minimum, so the bar only reaches down.
            errors = [[max(0.0, v - s) for v, s in zip(y, slow, strict=True)]]
            errors.append([max(0.0, f - v) for v, f in zip(y, fast, strict=True)])
            ax.errorbar(x, y, yerr=errors, marker="o", capsize=3, label=label)
        block_axis(ax, [r["block_size"] for r in group])
        scale_y(ax, [r[metric] for r in group])
        ax.set_ylabel(f"{unit} (bars: 20th-80th percentile time)")
        if len(groups) > 1:
            ax.set_title(geometry_label(group[0]), fontsize=9)
        legend_outside(ax, rows=entries)
    for ax in axes[len(groups) :]:
        ax.set_visible(False)
    geometry = geometry_label(next(iter(groups.values()))[0]) if len(groups) == 1 else ""
    timed = "median" if is_gpu_row(rows[0]) else "minimum"
    subtitle = f"{geometry + '; ' if geometry else ''}{_run_line(rows)}"
    figure.suptitle(f"{kernel}: {unit} at the {timed} time\n{subtitle}", fontsize=10)
    return figure


def new_figure(**kwargs: object) -> Figure:
    """A matplotlib ``Figure`` (no pyplot, no display), or ``MissingExtraError`` in one line."""
    return require("matplotlib.figure", "plots").Figure(**kwargs)


def plot_rows(rows: Sequence[Row], out_dir: str | Path) -> list[Path]:
    """Write ``speedup.png`` (when any kernel has a baseline or a quantized pool) and
    ``<kernel>.png`` for every kernel in ``rows`` into ``out_dir``; returns the paths, the
    headline first."""
    require("matplotlib.figure", "plots")
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
