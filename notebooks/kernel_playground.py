# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Kernel playground
#
# Change the cache block size or the attention tile, run `kernels.paged_attention` on a
# realistic paged workload (randomly permuted blocks, sink + recent window), compare it with
# the float64 oracle and see where the error sits, then the same over FP8 / INT8 pools.
#
# `NOTEBOOK_SMALL=1` shrinks everything (CI runs this file as a script that way);
# `NOTEBOOK_OUT` is where the figures go (default: the clone's `out/notebooks`).

# %%
import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

from paged_video import kernels  # without a GPU, importing it switches Triton's interpreter on
from paged_video.bench.providers import quantized_pools
from paged_video.bench.sweep import ERROR_FLOOR
from paged_video.bench.workload import (
    Geometry,
    dequantized_sequences,
    make_workload,
    oracle_attention,
)
from paged_video.kernels import launch_table
from paged_video.kernels.paged_attention import table_key

SMALL = os.environ.get("NOTEBOOK_SMALL") == "1"
# The clone's out/notebooks whether this runs as a script (from the clone) or as a notebook
# (jupytext and Jupyter run it from notebooks/); a relative NOTEBOOK_OUT is the clone's too.
ROOT = Path.cwd().parent if Path("kernel_playground.py").is_file() else Path.cwd()
OUT = ROOT / os.environ.get("NOTEBOOK_OUT", "out/notebooks")
OUT.mkdir(parents=True, exist_ok=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# %% [markdown]
# ## The knobs
#
# `BLOCK_M`/`BLOCK_N` are powers of two >= 16, or `None` for the launcher's choice. A block
# size that is a multiple of `BLOCK_N` takes the contiguous path (one table read per key tile);
# any other size looks the block up per key row.

# %%
BLOCK_SIZE = 24
BLOCK_M, BLOCK_N = None, None
if SMALL or DEVICE == "cpu":
    geometry = Geometry(
        chunk_size=16 if SMALL else 48,
        frames=2,
        sink_chunks=1,
        window_chunks=3,
        heads=4,
        kv_heads=2,
        head_dim=32,
        dtype="fp32",
    )
else:  # the shipped model
    geometry = Geometry(
        chunk_size=1560,
        frames=3,
        sink_chunks=9,
        window_chunks=9,
        heads=40,
        kv_heads=40,
        head_dim=128,
        dtype="bf16",
    )
print(geometry, "queries", geometry.q_tokens, "keys", geometry.kv_tokens)

# %%
workload = make_workload(geometry, BLOCK_SIZE, device=DEVICE)
tiles = kernels.choose_tiles(
    block_size=BLOCK_SIZE,
    head_dim=geometry.head_dim,
    max_seqlen_q=geometry.q_tokens,
    dtype=geometry.torch_dtype,
    block_m=BLOCK_M,
    block_n=BLOCK_N,
)
print("tiles:", tiles)
# On a GPU, a call that names neither tile nor variant takes the launch table's row for its
# class (head_dim class, key path at the built-in tile, K/V mode); under the interpreter the
# table is not read. Each row says where it comes from (a GPU run, or compile evidence).
row = launch_table.lookup(*table_key(BLOCK_SIZE, geometry.head_dim), "same")
if row is not None:
    print("launch table row on a GPU:", {k: row[k] for k in ("variant", "block_n", "source")})
print("block table of sequence 0:", workload.block_table[0].tolist())


def run_kernel(w, block_m=None, block_n=None):
    return kernels.paged_attention(
        *w.attention_args(),
        max_seqlen_q=w.geometry.q_tokens,
        block_m=block_m,
        block_n=block_n,
    )


out = run_kernel(workload, BLOCK_M, BLOCK_N)
want = oracle_attention(workload)
error = (out.double() - want).abs()
scale = want.abs().max().item()
worst = error.max().item()
print(f"max |error| {worst:.3g}, relative to max |oracle| {worst / scale:.3g}")

# %% [markdown]
# ## Where the error is
#
# Left: the largest error over `head_dim` for every query token and head, relative to the
# oracle's largest magnitude, on a fixed colour range (1e-9 .. 1e-1) with the tolerance the
# benchmark allows this dtype marked red on the scale. Right: how the per-element errors are
# spread (a wrong block shows as a band of query tokens or a second mode far to the right).

# %%
tolerance = ERROR_FLOOR[geometry.dtype]
per_token = error.amax(dim=2).cpu().numpy() / scale  # (queries, heads)
figure, (heat, spread) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
image = heat.imshow(
    np.log10(np.maximum(per_token.T, 1e-12)),
    aspect="auto",
    interpolation="nearest",
    cmap="viridis",
    vmin=-9,
    vmax=-1,
)
heat.set_xlabel("query token")
heat.set_ylabel("head")
heat.set_yticks(range(geometry.heads))
tile = f"{tiles['BLOCK_M']}x{tiles['BLOCK_N']}"
heat.set_title(f"relative max error, block {BLOCK_SIZE}, tile {tile} (red: tolerance)")
bar = figure.colorbar(image, ax=heat, label="log10 relative max error")
bar.ax.axhline(np.log10(tolerance), color="red", linewidth=2)
flat = error.flatten().cpu().numpy()
spread.hist(np.log10(flat[flat > 0]), bins=60)
spread.set_yscale("log")  # counts span decades: a lone far-off mode still shows
spread.set_xlabel("log10 |error| (exact elements left out)")
spread.set_ylabel("elements")
spread.set_title(f"{(flat == 0).mean():.0%} of elements exact")
figure.savefig(OUT / "playground_error.png", dpi=100)

# %% [markdown]
# ## Block sizes and tiles side by side
#
# The same attention for every combination: only the layout and the tiling change, so every
# cell should sit at rounding level.

# %%
block_sizes = [8, 16, 24, 64] if SMALL else [8, 16, 24, 32, 64, 128, 520]
tile_choices = [(None, None), (16, 16), (32, 64)]
relative = np.zeros((len(block_sizes), len(tile_choices)))
for i, block_size in enumerate(block_sizes):
    w = make_workload(geometry, block_size, device=DEVICE)
    for j, (block_m, block_n) in enumerate(tile_choices):
        got = run_kernel(w, block_m, block_n).double()
        relative[i, j] = (got - want).abs().max().item() / scale

# The colour range is fixed (1e-9 .. 1e-1 relative error) so rounding-level cells look alike in
# every run; the line on the colour bar is the tolerance the benchmark allows this dtype (one
# rounding step), and a cell above it is printed red.
figure, ax = plt.subplots(figsize=(6.5, 4), layout="constrained")
image = ax.imshow(
    np.log10(np.maximum(relative, 1e-12)), cmap="viridis", vmin=-9, vmax=-1, aspect="auto"
)
for (i, j), value in np.ndenumerate(relative):
    colour = "red" if value > tolerance else "white"
    ax.text(j, i, f"{value:.1e}", ha="center", va="center", color=colour, fontsize=8)
labels = ["auto" if m is None else f"{m}x{n}" for m, n in tile_choices]
ax.set_xticks(range(len(tile_choices)), labels)
ax.set_yticks(range(len(block_sizes)), [str(b) for b in block_sizes])
ax.set_xlabel("tile (BLOCK_M x BLOCK_N)")
ax.set_ylabel("block size")
ax.set_title(
    f"relative max error against float64, {geometry.dtype}\n"
    f"red line on the scale: the tolerance, {tolerance:.0e}",
    fontsize=10,
)
bar = figure.colorbar(image, ax=ax, label="log10 relative max error")
bar.ax.axhline(np.log10(tolerance), color="red", linewidth=2)
figure.savefig(OUT / "playground_grid.png", dpi=100)
print("relative max error against float64, block size by tile:")
print(f"{'block':>6}  " + "  ".join(f"{label:>8}" for label in labels))
for block_size, errors in zip(block_sizes, relative, strict=True):
    print(f"{block_size:>6}  " + "  ".join(f"{value:8.1e}" for value in errors))

# %% [markdown]
# ## Quantized pools (INT8)
#
# The same workload with its pools written as int8 codes plus a float32 scale per (slot, KV
# head) (the e4m3 pool was deleted, issue 45: k8v16 and k8v8 replace it). Two errors, kept
# apart: the kernel's against the oracle that dequantizes the same codes in float64 (rounding
# level for the dequantizing mode), and the quantization's own, against the unquantized oracle
# above.

# %%
modes = {"int8": torch.int8}
kernel_error, quantization_error = {}, {}
for label, kv_dtype in modes.items():
    pools = quantized_pools(workload, kv_dtype)
    got = kernels.paged_attention(
        workload.q,
        pools.k_cache,
        pools.v_cache,
        workload.block_table,
        workload.cu_seqlens_q,
        workload.seq_lens_k,
        max_seqlen_q=geometry.q_tokens,
        k_scale=pools.k_scale,
        v_scale=pools.v_scale,
    ).double()
    keys, values = dequantized_sequences(workload, pools)
    dequantized = oracle_attention(workload, keys=keys, values=values)
    kernel_error[label] = (got - dequantized).abs().max().item() / scale
    quantization_error[label] = (got - want).abs().max().item() / scale
    print(
        f"{label:13s} kernel vs dequantizing oracle {kernel_error[label]:.2e}, "
        f"vs unquantized oracle {quantization_error[label]:.2e} (relative max error)"
    )

figure, ax = plt.subplots(figsize=(6, 4), layout="constrained")
positions = np.arange(len(modes))
ax.bar(positions - 0.2, list(kernel_error.values()), 0.4, label="kernel vs dequantizing oracle")
ax.bar(positions + 0.2, list(quantization_error.values()), 0.4, label="vs unquantized oracle")
ax.set_xticks(positions, list(modes))
ax.set_yscale("log")
ax.set_ylabel("relative max error")
ax.set_title(f"quantized pools, block {BLOCK_SIZE}")
ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize="small")
figure.savefig(OUT / "playground_quantized.png", dpi=100)
