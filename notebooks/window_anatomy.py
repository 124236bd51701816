# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # The window's anatomy
#
# A rollout through `paging/`, drawn tick by tick: the sequence's block table (sink blocks,
# history, null entries left by eviction, and compaction removing them), then what each
# scratch (denoising) forward reads: the sink, the out-of-window boundary tokens that whole
# blocks bring in, the recent range, and the forward's own chunk, which starts in the free tail
# of the history's last block and spills on into scratch blocks.
#
# Tiny numbers so every slot is visible: frames of `C = 6` tokens, blocks of `B = 4`, a sink of
# one frame and a window of three. `NOTEBOOK_SMALL=1` runs fewer ticks (CI runs this file as a
# script that way); `NOTEBOOK_OUT` is where the figures go (default: the clone's `out/notebooks`).

# %%
import os
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Patch, Rectangle

from paged_video import (
    kernels,  # without a GPU, importing it switches Triton's interpreter on
    reference,
)
from paged_video.paging import NULL_BLOCK, PagedKVCache, PagingConfig
from paged_video.paging import window as paging_window
from paged_video.reference.attention import gather_sequence

SMALL = os.environ.get("NOTEBOOK_SMALL") == "1"
# The clone's out/notebooks whether this runs as a script (from the clone) or as a notebook
# (jupytext and Jupyter run it from notebooks/); a relative NOTEBOOK_OUT is the clone's too.
ROOT = Path.cwd().parent if Path("window_anatomy.py").is_file() else Path.cwd()
OUT = ROOT / os.environ.get("NOTEBOOK_OUT", "out/notebooks")
OUT.mkdir(parents=True, exist_ok=True)
TICKS = 8 if SMALL else 14

config = PagingConfig(block_size=4, chunk_size=6, window_chunks=3, sink_chunks=1)
cache = PagedKVCache(config, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
layer = cache.layer(0)
B, C, S = config.block_size, config.chunk_size, config.sink_tokens
print("table width", cache.table_width, "| managed blocks 1 ..", cache.pool.num_blocks)
unit = paging_window.compaction_unit(config)
print("scratch blocks from", cache.first_scratch_block, "| compaction unit", unit, "tokens")

# %% [markdown]
# ## The rollout
#
# Every tick generates one frame: a scratch forward (it only reads), then the committing
# forward that writes the frame for good, then commit: eviction and compaction. Every K/V
# written carries its *model position* in channel 0, so reading the keys back shows exactly
# which tokens a forward attends to.

# %%


def write(slots: torch.Tensor, first_position: int) -> None:
    positions = torch.arange(first_position, first_position + len(slots), dtype=torch.float32)
    kv = positions.view(-1, 1, 1).expand(-1, 1, 4).contiguous()
    kernels.write_slots(kv, kv, layer.k_flat, layer.v_flat, slots)


session = cache.open_session()
sequence = session.sequence("main")
geometry = reference.WindowGeometry(
    chunk_size=C, block_size=B, sink_chunks=config.sink_chunks, window_chunks=3
)
tables, reads = [], []
for tick in range(TICKS):
    history = sequence.absolute
    scratch = cache.plan(session, "main", C)
    inputs = scratch.prepare()
    write(inputs.video_slots, history)
    seq_len = int(inputs.seq_lens_k[0])
    row = inputs.block_table[0]
    read = gather_sequence(layer.k, row, seq_len)[:, 0, 0].long().tolist()
    assert read == reference.block_read_positions(geometry, history, C), tick
    reads.append(
        {
            "row": row.tolist(),
            "seq_len": seq_len,
            "gap": inputs.key_gap[0].tolist(),
            "slots": inputs.video_slots.tolist(),
            "history": history,
        }
    )

    committing = cache.plan(session, "main", C, commit=True)
    write(committing.prepare().video_slots, history)
    committing.commit()
    tables.append(
        {
            "table": list(sequence.block_table),
            "compacted": sequence.compacted,
            "committed": sequence.committed,
            "evicted": sequence.evicted,
        }
    )
print("every scratch forward read exactly the oracle's block-read positions")

# %% [markdown]
# ## Block tables over ticks
#
# Each row is the table after a tick's commit, every entry drawn at the *model* positions it
# holds (sink entries at their storage positions; later entries shifted by what compaction
# removed). Null entries are evicted blocks still in the table; when a whole `lcm(C, B)` of them
# has gathered, compaction deletes them and the row's entries jump back in storage, not in model
# position. Thin lines are frame edges.

# %%
COLORS = {
    "sink": "#4c72b0",
    "history": "#55a868",
    "null": "#d0d0d0",
    "gap": "#dd8452",
    "chunk": "#c44e52",
    "scratch": "#8172b3",
}
sink_entries = paging_window.sink_blocks(config)
ID_BOX = {"facecolor": "white", "edgecolor": "none", "pad": 1.5}
figure, ax = plt.subplots(figsize=(13, 0.45 * TICKS + 1.5), layout="constrained")
for tick, state in enumerate(tables):
    y = TICKS - 1 - tick
    for entry, block in enumerate(state["table"]):
        start = entry * B + (state["compacted"] if entry >= sink_entries else 0)
        kind = "sink" if entry < sink_entries else ("null" if block == NULL_BLOCK else "history")
        filled = min(B, state["committed"] - entry * B)
        ax.add_patch(
            Rectangle((start, y + 0.1), filled, 0.8, facecolor=COLORS[kind], edgecolor="black")
        )
        # A white box behind the id: the sink's end line may cross the block's middle.
        ax.text(
            start + filled / 2,
            y + 0.5,
            str(block),
            ha="center",
            va="center",
            fontsize=7,
            bbox=ID_BOX,
            zorder=4,
        )
    label = f"t{tick}: committed {state['committed']}, compacted {state['compacted']}"
    ax.text(-1, y + 0.5, label, ha="right", va="center", fontsize=8)
end = max(s["committed"] + s["compacted"] for s in tables)
for frame_edge in range(0, end + 1, C):
    ax.axvline(frame_edge, color="black", linewidth=2 if frame_edge == S else 0.3)
ax.set_xlim(-40, end + 1)
ax.set_ylim(0, TICKS)
ax.set_xticks(range(0, end + 1, 2 * C))
ax.set_yticks([])
ax.set_xlabel("model position (tokens); thick line: end of the sink")
ax.set_title("block table after each commit (numbers are block ids)")
figure.legend(
    handles=[Patch(color=COLORS[k], label=k) for k in ("sink", "history", "null")],
    loc="outside lower center",
    ncols=3,
)
figure.savefig(OUT / "window_block_tables.png", dpi=100)

# %% [markdown]
# ## What each scratch forward reads
#
# Each row is one scratch forward's attention row, in key order: whole blocks, so the sink's
# last block and the recent range's first block may bring in tokens the window does not keep
# (the plan's `key_gap`, orange). The forward's own frame (red) continues the history's
# partly filled tail block where it is resident and spills on into scratch blocks (hatched,
# outside the pool); the entries after `seq_lens_k` are null padding of the fixed width.

# %%
figure, ax = plt.subplots(figsize=(11, 0.45 * TICKS + 1.5), layout="constrained")
width = cache.table_width
for tick, forward in enumerate(reads):
    y = TICKS - 1 - tick
    gap_lo, gap_hi = forward["gap"]
    chunk_start = forward["seq_len"] - C
    for key in range(width * B):
        block = forward["row"][key // B]
        if key >= forward["seq_len"]:
            kind = "null"
        elif key >= chunk_start:
            kind = "chunk"
        elif key < gap_lo:
            kind = "sink"
        elif key < gap_hi:
            kind = "gap"
        else:
            kind = "history"
        scratch_block = block >= cache.first_scratch_block
        ax.add_patch(
            Rectangle(
                (key, y + 0.05),
                1,
                0.7,
                facecolor=COLORS[kind],
                hatch="///" if scratch_block else None,
                edgecolor="white",
                linewidth=0.3,
            )
        )
    for entry, block in enumerate(forward["row"]):
        ax.add_patch(
            Rectangle((entry * B, y + 0.05), B, 0.7, fill=False, edgecolor="black", linewidth=1)
        )
        ax.text(entry * B + B / 2, y + 0.78, str(block), ha="center", va="bottom", fontsize=6)
    first_chunk_block = forward["slots"][0] // B
    spill = "spills from the tail block" if first_chunk_block < cache.first_scratch_block else ""
    label = f"t{tick}: history {forward['history']}, seq_len {forward['seq_len']} {spill}"
    ax.text(-1, y + 0.4, label, ha="right", va="center", fontsize=8)
ax.set_xlim(-22, width * B + 1)
ax.set_ylim(0, TICKS)
ax.set_xticks(range(0, width * B + 1, B))
ax.set_yticks([])
ax.set_xlabel("key index of the attention row (block ids above each block)")
ax.set_title("scratch forwards: what attention reads")
legend = [Patch(color=COLORS[k], label=k) for k in ("sink", "gap", "history", "chunk", "null")]
legend.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="scratch block"))
figure.legend(handles=legend, loc="outside lower center", fontsize=8, ncols=6)
figure.savefig(OUT / "window_reads.png", dpi=100)

# %% [markdown]
# ## The kernel over the last plan
#
# The same row attended by `kernels.paged_attention` and by the float64 oracle.

# %%
history = sequence.absolute
plan = cache.plan(session, "main", C)
inputs = plan.prepare()
write(inputs.video_slots, history)
q = torch.randn(C, 2, 4)
got = kernels.paged_attention(q, layer.k, layer.v, **inputs.attention_kwargs())
want = reference.paged_attention(q, layer.k, layer.v, **inputs.attention_kwargs())
print("max |kernel - oracle|:", (got - want).abs().max().item())
assert torch.allclose(got, want, atol=1e-5)
cache.close_session(session)
print("free blocks after closing:", cache.pool.num_free, "of", cache.pool.num_blocks)

# %% [markdown]
# ## Forks: many futures from one past
#
# `cache.fork(session)` starts a session that continues another's committed history: its
# block table lists the same blocks, each holding one more reference in the pool, and nothing
# is copied. Only the history's partly written tail block is ever written again (a forward
# continues it), so the first forward of a fork whose tail block is shared gives the fork its
# own copy of that block first (copy-on-write); the last holder keeps the original. Eviction
# drops a fork's references; a block returns to the pool when nobody holds it.
#
# Here the parent generates 5 frames and stays as the fork point; futures A and B fork from it,
# A generates one frame and is forked again (A1), then every future generates its own frames.
# Each token's K/V carries its model position (channel 0) and its writer (channel 1), so every
# session is checked to hold exactly its own past.

# %%
fork_cache = PagedKVCache(
    config, num_layers=1, num_kv_heads=1, head_dim=4, session_capacity=4, dtype=torch.float32
)
fork_layer = fork_cache.layer(0)
copied: set[int] = set()  # held blocks made by copy-on-write
copy_log: list[tuple[int, int]] = []
copy_contents = fork_cache.pool.copy_contents


def copy_and_track(source: int, target: int) -> None:
    copy_contents(source, target)
    copied.add(target)
    copy_log.append((source, target))


fork_cache.pool.copy_contents = copy_and_track
WRITERS = {"parent": 0.0, "A": 1.0, "B": 2.0, "A1": 3.0}
futures = {"parent": fork_cache.open_session()}
writer_of: dict[str, dict[int, float]] = {"parent": {}}
forked_at: dict[str, tuple[str, int]] = {}


def generate_frame(name: str) -> None:
    """A scratch (denoising) forward, then the committing one, of session ``name``."""
    session = futures[name]
    history = session.sequence("main").absolute
    for commit in (False, True):
        plan = fork_cache.plan(session, "main", C, commit=commit)
        slots = plan.prepare().video_slots
        positions = torch.arange(history, history + C, dtype=torch.float32)
        kv = torch.stack([positions, torch.full_like(positions, WRITERS[name])], dim=-1)
        kv = torch.cat([kv, torch.zeros(C, 2)], dim=-1).view(C, 1, 4)
        kernels.write_slots(kv, kv, fork_layer.k_flat, fork_layer.v_flat, slots)
        plan.commit()
    writer_of[name].update(dict.fromkeys(range(history, history + C), WRITERS[name]))
    # A copy evicted by everyone went back to the pool; its id may be handed out again.
    copied.intersection_update(b for b in copied if fork_cache.pool.is_held(b))


def fork(parent: str, name: str) -> None:
    futures[name] = fork_cache.fork(futures[parent])
    writer_of[name] = dict(writer_of[parent])
    forked_at[name] = (parent, futures[parent].sequence("main").absolute)


def resident(name: str) -> list[tuple[int, int]]:
    """(model position, slot) of every live token the session's table holds."""
    seq = futures[name].sequence("main")
    pairs = []
    for entry, block in enumerate(seq.block_table):
        for p in range(entry * B, min((entry + 1) * B, seq.committed)):
            if block != NULL_BLOCK and not S <= p < S + seq.evicted:
                pairs.append((p if p < S else p + seq.compacted, block * B + p % B))
    return pairs


def check_every_past() -> None:
    for name in futures:
        for position, slot in resident(name):
            held = fork_layer.k_flat[slot, 0, :2].tolist()
            assert held == [position, writer_of[name][position]], (name, position, held)


def tree_state() -> dict[str, dict]:
    pool = fork_cache.pool
    state = {}
    for name, session in futures.items():
        seq = session.sequence("main")
        entries = []
        for entry, block in enumerate(seq.block_table):
            start = entry * B + (seq.compacted if entry >= paging_window.sink_blocks(config) else 0)
            filled = min(B, seq.committed - entry * B)
            if block == NULL_BLOCK:
                kind = "null"
            else:
                kind = "shared" if pool.refcount(block) > 1 else "own"
            entries.append((start, filled, block, kind, block in copied))
        state[name] = {"entries": entries, "end": seq.absolute}
    stats = fork_cache.pool_stats
    return {"sessions": state, "held": stats.held, "separate": stats.references}


for _ in range(5):
    generate_frame("parent")
fork("parent", "A")
fork("parent", "B")
moments = [("A and B forked from the parent: every block shared", tree_state())]
generate_frame("A")
fork("A", "A1")
moments.append(("A generated a frame (its tail block copied first), then A1 forked", tree_state()))
for name in ("A", "A1", "B"):
    generate_frame(name)
moments.append(("A, A1 and B generated a frame each (B copied the tail block too)", tree_state()))
for _ in range(2 if SMALL else 3):
    for name in ("A", "A1", "B"):
        generate_frame(name)
check_every_past()
moments.append(
    ("the futures diverged: each holds its own frames, the sink stays shared", tree_state())
)
print("every future holds exactly its own past; copies on write (block -> copy):", copy_log)
for title, moment in moments:
    print(f"{title}: {moment['held']} blocks held, {moment['separate']} as separate sessions")

# %% [markdown]
# ## The fork tree
#
# Each panel is one moment: a row per session (the parent at the top), each table entry drawn
# at the model positions it holds, with its block id. Blue blocks are shared (more than one
# table holds them), green ones a session's own, grey null entries evicted; hatched blocks were
# made by copy-on-write (a copy of a shared tail block). Red dashed lines are forks, at the
# position where the child's own frames start.

# %%
FORK_COLORS = {"shared": "#4c72b0", "own": "#55a868", "null": "#d0d0d0"}
ORDER = ["parent", "A", "A1", "B"]
figure, axes = plt.subplots(
    len(moments), 1, figsize=(13, 2.2 * len(moments) + 1), layout="constrained"
)
end = max(s["end"] for _, m in moments for s in m["sessions"].values())
for ax, (title, moment) in zip(axes, moments, strict=True):
    names = [name for name in ORDER if name in moment["sessions"]]
    rows = {name: len(names) - 1 - i for i, name in enumerate(names)}
    for name in names:
        y = rows[name]
        for start, filled, block, kind, was_copied in moment["sessions"][name]["entries"]:
            ax.add_patch(
                Rectangle(
                    (start, y + 0.15),
                    filled,
                    0.7,
                    facecolor=FORK_COLORS[kind],
                    hatch="///" if was_copied else None,
                    edgecolor="black",
                )
            )
            label = "" if block == NULL_BLOCK else str(block)
            ax.text(
                start + filled / 2,
                y + 0.5,
                label,
                ha="center",
                va="center",
                fontsize=7,
                bbox=ID_BOX,
                zorder=4,
            )
        ax.text(-1, y + 0.5, name, ha="right", va="center", fontsize=9)
        if name in forked_at:
            parent, position = forked_at[name]
            x = position + 0.4
            ax.plot([x, x], [rows[parent] + 0.5, y + 0.5], "--", color="#c44e52", linewidth=2)
            ax.plot([x], [y + 0.5], ">", color="#c44e52")
    ax.set_title(f"{title}: {moment['held']} blocks held, {moment['separate']} if separate")
    ax.set_xlim(-8, end + 1)
    ax.set_ylim(0, len(names))
    ax.set_yticks([])
    for frame_edge in range(0, end + 1, C):
        ax.axvline(frame_edge, color="black", linewidth=2 if frame_edge == S else 0.2)
axes[-1].set_xlabel("model position (tokens); thick line: end of the sink")
legend = [Patch(color=FORK_COLORS[k], label=k) for k in FORK_COLORS]
legend.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="copied on write"))
figure.legend(handles=legend, loc="outside lower center", ncols=4)
figure.savefig(OUT / "window_forks.png", dpi=100)
for session in futures.values():
    fork_cache.close_session(session)
assert fork_cache.pool.num_free == fork_cache.pool.num_blocks
