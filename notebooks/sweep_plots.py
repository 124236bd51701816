# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # The sweep's plots
#
# Reads a results CSV written by `python -m paged_video.bench sweep` (set `SWEEP_CSV`), or runs
# a small checked sweep here when none is given, then draws the standard per-kernel plots and two
# comparisons the CLI does not: the Triton kernel's speed against the fastest baseline, and
# the paged kernel against the staged path (gather + attention) at each block size.
#
# `NOTEBOOK_SMALL=1` makes the fallback sweep tiny (CI runs this file as a script that way);
# `NOTEBOOK_OUT` is where the figures go (default: the clone's `out/notebooks`).

# %%
import os
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from paged_video.bench.plot import block_axis, legend_outside, plot_rows, scale_y
from paged_video.bench.results import headline_ms, is_gpu_row, read_rows
from paged_video.bench.sweep import SweepConfig, run_sweep
from paged_video.bench.table import format_pivot, geometry_label, ratio_cases
from paged_video.bench.timing import TimingSettings
from paged_video.bench.workload import Geometry

SMALL = os.environ.get("NOTEBOOK_SMALL") == "1"
# The clone's out/notebooks whether this runs as a script (from the clone) or as a notebook
# (jupytext and Jupyter run it from notebooks/); a relative NOTEBOOK_OUT is the clone's too.
ROOT = Path.cwd().parent if Path("sweep_plots.py").is_file() else Path.cwd()
OUT = ROOT / os.environ.get("NOTEBOOK_OUT", "out/notebooks")
OUT.mkdir(parents=True, exist_ok=True)

# %%
if os.environ.get("SWEEP_CSV"):
    csv_path = Path(os.environ["SWEEP_CSV"])
else:
    geometry = Geometry(
        chunk_size=16 if SMALL else 40,
        frames=2,
        sink_chunks=1,
        window_chunks=3,
        heads=4,
        kv_heads=2,
        head_dim=32,
        dtype="fp32",
    )
    config = SweepConfig(
        geometries=(geometry,),
        block_sizes=(8, 16, 32) if SMALL else (8, 16, 24, 32, 64, 128),
        kernels=("paged_attention", "staged"),
        device="cuda" if torch.cuda.is_available() else "cpu",
        timing=TimingSettings(cpu_reps=1 if SMALL else 10),
    )
    csv_path = run_sweep(config, OUT / "sweep.csv", progress=False).csv_path
rows = read_rows(csv_path)
print(format_pivot(rows))

# %% [markdown]
# ## Throughput against block size, one figure per kernel

# %%
for path in plot_rows(rows, OUT):
    print("wrote", path)

# %% [markdown]
# ## Triton against the fastest baseline
#
# Above 1 the kernel is faster than every baseline measured at that block size (the oracle and
# the quantized pools are not baselines and are left out). The ratios span decades on a CPU,
# where the interpreter runs the kernel: the y axis is logarithmic then. CPU figures are not a
# speed; the titles say so.

# %%
cases = [c for c in ratio_cases(rows) if c["row"]["kernel"] == "paged_attention"]
by_geometry: dict[str, list[dict]] = {}
for case in cases:
    by_geometry.setdefault(geometry_label(case["row"]), []).append(case)
first = rows[0]
figures = "" if is_gpu_row(first) else f" ({first['figures']}: CPU figures, not a speed)"

figure, ax = plt.subplots(figsize=(8, 4), layout="constrained")
ratios = [1.0]
for label, group in by_geometry.items():
    points = sorted((c["row"]["block_size"], c["speedup"]) for c in group if c["speedup"])
    ax.plot([b for b, _ in points], [v for _, v in points], marker="o", label=label)
    ratios += [v for _, v in points]
ax.axhline(1.0, color="grey", linestyle="--", label="1.0: as fast as the fastest baseline")
block_axis(ax, [c["row"]["block_size"] for c in cases])
scale_y(ax, ratios)
ax.set_ylabel("fastest baseline time / triton time")
ax.set_title(f"paged_attention speed-up on {first['device']}{figures}", fontsize=9)
legend_outside(ax)
figure.savefig(OUT / "sweep_speedup.png", dpi=100)

# %% [markdown]
# ## Paged against staged
#
# Staging copies the visible blocks into contiguous buffers before attending; reading the
# pages directly saves that copy. The ratio shows what the copy costs at each block size.

# %%
figure, ax = plt.subplots(figsize=(8, 4), layout="constrained")
ratios, all_blocks = [1.0], []
for label in by_geometry:
    ours = {
        (r["kernel"], r["block_size"]): headline_ms(r)
        for r in rows
        if r["provider"] == "triton" and geometry_label(r) == label
    }
    blocks = sorted(b for k, b in ours if k == "paged_attention" and ("staged", b) in ours)
    costs = [ours["staged", b] / ours["paged_attention", b] for b in blocks]
    ax.plot(blocks, costs, marker="o", label=label)
    ratios += costs
    all_blocks += blocks
ax.axhline(1.0, color="grey", linestyle="--", label="1.0: staging costs nothing")
block_axis(ax, all_blocks or [1])
scale_y(ax, ratios)
ax.set_ylabel("staged time / paged time")
ax.set_title(f"what staging costs{figures}", fontsize=9)
legend_outside(ax)
figure.savefig(OUT / "sweep_paged_vs_staged.png", dpi=100)
