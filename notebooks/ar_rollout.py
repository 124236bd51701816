# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # An autoregressive rollout of a Wan transformer on the paged cache
#
# A tiny random-weight diffusers `WanTransformer3DModel` (2 layers, 2 heads of 32, latent
# frames of 8 x 12, so 24 tokens per frame after Wan's 1x2x2 patch) generates a video one
# frame per block, the way CausVid / Self-Forcing do: a few denoising forwards that only read
# the history, then one forward on the clean frame that commits its K/V. Both CFG branches run
# as one batch and one attention launch per layer (`models.wan_paged.PagedWanRollout`).
#
# The cache pages K/V in blocks of `B = 7` tokens (frames begin and end mid-block), keeps a
# sink of one frame and a window of three, and reads whole blocks (`exact_window=False`), so
# each forward also reads a few out-of-window boundary tokens. The dense reference
# (`reference/wan_rollout.py`) reads the same tokens and gives the same latents.
#
# `NOTEBOOK_SMALL=1` generates fewer blocks (CI runs this file as a script that way);
# `NOTEBOOK_OUT` is where the figures go (default: the clone's `out/notebooks`).

# %%
import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from paged_video.models.wan_paged import PagedWanRollout
from paged_video.paging import PagingConfig
from paged_video.reference.wan_rollout import reference_rollout

SMALL = os.environ.get("NOTEBOOK_SMALL") == "1"
# After models.wan_paged: it imports kernels (Triton's interpreter without a GPU) first.
from diffusers import WanTransformer3DModel

# The clone's out/notebooks whether this runs as a script (from the clone) or as a notebook
# (jupytext and Jupyter run it from notebooks/); a relative NOTEBOOK_OUT is the clone's too.
ROOT = Path.cwd().parent if Path("ar_rollout.py").is_file() else Path.cwd()
OUT = ROOT / os.environ.get("NOTEBOOK_OUT", "out/notebooks")
OUT.mkdir(parents=True, exist_ok=True)
BLOCKS = 5 if SMALL else 10
SIGMAS = (1.0,) if SMALL else (1.0, 0.6, 0.3)
C, B = 24, 7

torch.manual_seed(0)
model = WanTransformer3DModel(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=32,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=32,
    ffn_dim=64,
    num_layers=2,
    rope_max_seq_len=64,
).eval()
g = torch.Generator().manual_seed(1)
noise = torch.randn(1, 4, BLOCKS, 8, 12, generator=g)
prompt, negative = torch.randn(2, 1, 5, 16, generator=g)
config = PagingConfig(block_size=B, chunk_size=C, sink_chunks=1, window_chunks=3)
print(f"{BLOCKS} blocks of 1 frame, {len(SIGMAS)} denoising forwards + 1 committing each")

# %% [markdown]
# ## The rollout, and the same rollout on a dense KV list

# %%
with PagedWanRollout(model, config) as rollout:
    pool_blocks = rollout.cache.pool.num_blocks
    first_scratch = rollout.cache.first_scratch_block
    result = rollout.generate(
        noise, prompt, negative, frames_per_block=1, sigmas=SIGMAS, guidance_scale=3.0
    )
dense = reference_rollout(
    model,
    noise,
    prompt,
    negative,
    frames_per_block=1,
    sink_frames=1,
    window_frames=3,
    sigmas=SIGMAS,
    guidance_scale=3.0,
    read_block_size=B,
)
error = (result.latents - dense.latents).abs().max().item()
print(f"max |paged - dense| latents: {error:.2e}")
assert error < 1e-4
for ours, theirs in zip(result.reads, dense.reads, strict=True):
    assert all(o.positions["positive"] == t.positions for o, t in zip(ours, theirs, strict=True))

# %% [markdown]
# ## Which frames each forward read
#
# One column per forward (denoising forwards, then the committing one, per block); one row per
# frame. Colour is the fraction of the frame's 24 tokens the forward read: the sink (frame 0),
# the recent frames of the window, the block's own frame, and the pale slivers of boundary
# tokens that whole 7-token blocks bring in from just outside the window.

# %%
forwards = [read for block in result.reads for read in block]
coverage = np.zeros((BLOCKS, len(forwards)))
for column, read in enumerate(forwards):
    for position in read.positions["positive"]:
        coverage[position // C, column] += 1 / C
fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(forwards)), 4))
image = ax.imshow(coverage, origin="lower", aspect="auto", cmap="Blues", vmin=0, vmax=1)
for column, read in enumerate(forwards):
    ax.plot(column, read.first_frame, "s" if read.commit else "o", color="tab:orange", ms=5)
ax.set_xticks(range(len(forwards)))
ax.set_xticklabels([f"{r.block}{'c' if r.commit else 'd'}" for r in forwards], fontsize=7)
ax.set_xlabel("forward (block, d = denoising, c = committing)")
ax.set_ylabel("frame")
ax.set_title("Frames read per forward (orange: the forward's own frame)")
fig.colorbar(image, ax=ax, label="fraction of the frame's tokens read")
fig.tight_layout()
fig.savefig(OUT / "ar_rollout_reads.png", dpi=120)

# %% [markdown]
# ## How the pool's blocks were used
#
# The block ids each forward's attention read, for both CFG branches: managed pool blocks
# (held by the sequences, freed as the window slides) and each branch's scratch blocks, where
# denoising forwards put their frame. The line is the pool's free blocks after each forward.

# %%
fig, ax = plt.subplots(figsize=(max(7, 0.35 * len(forwards)) + 2.5, 4.5), layout="constrained")
colours = {"positive": "tab:blue", "negative": "tab:green"}
for column, read in enumerate(forwards):
    for branch, blocks in read.blocks.items():
        for block_id in blocks:
            scratch = block_id >= first_scratch
            ax.scatter(
                column, block_id, marker="x" if scratch else "s", s=18, color=colours[branch]
            )
ax.axhline(first_scratch - 0.5, color="grey", lw=0.8, ls="--")
ax.set_xticks(range(len(forwards)))
ax.set_xticklabels([f"{r.block}{'c' if r.commit else 'd'}" for r in forwards], fontsize=7)
ax.set_xlabel("forward (block, d = denoising, c = committing)")
ax.set_ylabel("block id (above the dashed line: scratch)")
ax.yaxis.set_major_locator(MaxNLocator(integer=True))
free = ax.twinx()
free.plot(range(len(forwards)), [r.free_blocks for r in forwards], color="tab:red", marker=".")
free.set_ylabel("free pool blocks", color="tab:red")
# A margin above the pool's size, so a line at "all free" is drawn, not clipped at the frame.
free.set_ylim(-0.5, pool_blocks + 1.5)
free.yaxis.set_major_locator(MaxNLocator(integer=True))
fig.legend(
    handles=[
        Patch(color=colours["positive"], label="positive branch"),
        Patch(color=colours["negative"], label="negative branch"),
        Line2D([], [], marker="s", ls="", color="black", label="managed pool block"),
        Line2D([], [], marker="x", ls="", color="black", label="scratch block"),
        Line2D([], [], color="tab:red", marker=".", label="free pool blocks (right axis)"),
        Line2D([], [], color="grey", lw=0.8, ls="--", label="first scratch block"),
    ],
    loc="outside right upper",
    fontsize=8,
)
ax.set_title(f"Blocks read per forward (pool of {pool_blocks} blocks of {B} tokens)")
fig.savefig(OUT / "ar_rollout_blocks.png", dpi=120)
print("figures in", OUT)
