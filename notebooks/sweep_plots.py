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
# `NOTEBOOK_OUT` is where the figures go (default `out/notebooks`).

# %%
import os
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from paged_video.bench.plot import plot_rows
from paged_video.bench.results import read_rows
from paged_video.bench.sweep import SweepConfig, run_sweep
from paged_video.bench.table import format_pivot, geometry_label
from paged_video.bench.timing import TimingSettings
from paged_video.bench.workload import Geometry

SMALL = os.environ.get("NOTEBOOK_SMALL") == "1"
OUT = Path(os.environ.get("NOTEBOOK_OUT", "out/notebooks"))
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
        timing=TimingSettings(cpu_reps=1 if SMALL else 3),
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
# Above 1 the kernel is faster than every baseline measured at that block size (the oracle is
# not a baseline and is left out).

# %%
attention = [r for r in rows if r["kernel"] == "paged_attention" and r["provider"] != "reference"]
by_geometry: dict[str, list[dict]] = {}
for row in attention:
    by_geometry.setdefault(geometry_label(row), []).append(row)

figure, ax = plt.subplots(figsize=(7, 4), layout="constrained")
for label, group in by_geometry.items():
    blocks = sorted({r["block_size"] for r in group})
    speedups = []
    for block in blocks:
        here = [r for r in group if r["block_size"] == block]
        ours = min(r["p50_ms"] for r in here if r["provider"] == "triton")
        baselines = [r["p50_ms"] for r in here if r["provider"] != "triton"]
        speedups.append(min(baselines) / ours if baselines else float("nan"))
    ax.plot(blocks, speedups, marker="o", label=label)
ax.axhline(1.0, color="grey", linestyle="--")
ax.set_xscale("log", base=2)
ax.set_xlabel("block size (tokens)")
ax.set_ylabel("fastest baseline time / triton time")
ax.set_title(f"paged_attention speed-up ({rows[0]['figures']} figures, {rows[0]['device']})")
ax.legend(fontsize=8)
figure.savefig(OUT / "sweep_speedup.png", dpi=100)

# %% [markdown]
# ## Paged against staged
#
# Staging copies the visible blocks into contiguous buffers before attending; reading the
# pages directly saves that copy. The ratio shows what the copy costs at each block size.

# %%
figure, ax = plt.subplots(figsize=(7, 4), layout="constrained")
for label, group in by_geometry.items():
    paged = {r["block_size"]: r["p50_ms"] for r in group if r["provider"] == "triton"}
    staged = {
        r["block_size"]: r["p50_ms"]
        for r in rows
        if r["kernel"] == "staged" and r["provider"] == "triton" and geometry_label(r) == label
    }
    blocks = sorted(paged.keys() & staged.keys())
    ax.plot(blocks, [staged[b] / paged[b] for b in blocks], marker="o", label=label)
ax.axhline(1.0, color="grey", linestyle="--")
ax.set_xscale("log", base=2)
ax.set_xlabel("block size (tokens)")
ax.set_ylabel("staged time / paged time")
ax.set_title("what staging costs")
ax.legend(fontsize=8)
figure.savefig(OUT / "sweep_paged_vs_staged.png", dpi=100)
