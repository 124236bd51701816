"""K forked futures of one rollout: the pool blocks they hold, shared and exclusive, in bytes.

``python -m paged_video.bench.forks`` rolls one session (both CFG branches) at the shipped
geometry until its window is full and sliding, keeps it as the fork point, forks it K times and
continues every fork ``--blocks`` blocks (per block: ``--steps`` denoising forwards, then the
committing one). Bookkeeping only: the pools live on PyTorch's meta device, so the shipped
sizes cost no memory, and the bytes are the real ones (block bytes times blocks).

Printed per K (blocks of both branches): the window held at the fork, what each fork wrote
since (its new blocks and its copy of the shared tail block; ``copied``: the tail blocks copied
on write, all forks), the blocks held and their bytes against K + 1 separate sessions each
holding its own window, and the pool that would hold the run (its peak, for ``pool_blocks``)
against the default sizing for K + 1 sessions. The identity held = window + written is checked.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from paged_video.bench.formats import choice
from paged_video.paging import PagedKVCache, PagingConfig, Session, window
from paged_video.paging.config import KV_FORMATS

CFG_BRANCHES = ("positive", "negative")
GIB = 2**30


@dataclass(frozen=True)
class ForkRun:
    """What one run of K forks held (blocks of every branch)."""

    futures: int
    window_blocks: int  # held by the fork point when it was forked
    written_blocks: list[int]  # per fork: its blocks no other session holds
    copied_blocks: int  # tail blocks copied on write, over every fork and branch
    held_blocks: int
    peak_blocks: int  # the most blocks held at once: the pool the run needs
    separate_blocks: int  # table entries: what K + 1 separate sessions would hold
    block_bytes: int
    default_pool_blocks: int


class PeakTracker:
    """The most blocks the pool held at once, sampled after every prepare and commit."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache, self.peak = cache, 0

    def sample(self) -> None:
        self.peak = max(self.peak, self.cache.pool.num_held)


def advance(cache: PagedKVCache, session: Session, tokens: int, steps: int, peak) -> None:
    """One generated block of every branch: ``steps`` scratch forwards, one committing one."""
    for _ in range(steps):
        for branch in cache.branches:
            cache.plan(session, branch, tokens).prepare()
            peak.sample()
    plans = [cache.plan(session, branch, tokens, commit=True) for branch in cache.branches]
    for plan in plans:
        plan.prepare()
    peak.sample()
    for plan in plans:
        plan.commit()


def run_forks(
    config: PagingConfig,
    *,
    futures: int,
    blocks: int,
    steps: int,
    frames_per_block: int,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> ForkRun:
    """Roll the fork point until the window slides, fork ``futures`` times, advance each."""
    cache = PagedKVCache(
        config,
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        session_capacity=futures + 1,
        branches=CFG_BRANCHES,
        dtype=dtype,
        device="meta",
    )
    # Nothing is written (meta pools): the layers' first-write state counts as chosen, as a
    # forward's first write leaves it (a cache refuses committed tokens under no chosen state).
    for chosen in (cache.k_means_chosen, cache.equalizers_chosen, cache.v_scales_chosen):
        chosen.fill_(True)
    tokens = frames_per_block * config.chunk_size
    peak = PeakTracker(cache)
    copies = []
    copy_contents = cache.pool.copy_contents

    def counted_copy(source: int, target: int) -> None:
        copies.append(source)
        copy_contents(source, target)

    cache.pool.copy_contents = counted_copy
    parent = cache.open_session()
    frames = config.sink_chunks + config.window_chunks
    for _ in range(math.ceil(frames / frames_per_block) + 1):
        advance(cache, parent, tokens, steps, peak)
    window_blocks = cache.pool.num_held
    forks = [cache.fork(parent) for _ in range(futures)]
    for _ in range(blocks):
        for fork in forks:
            advance(cache, fork, tokens, steps, peak)
    stats = cache.pool_stats
    written = [cache.session_blocks(fork).exclusive for fork in forks]
    if stats.held != window_blocks + sum(written):
        raise AssertionError(f"held {stats.held} != window {window_blocks} + written {written}")
    return ForkRun(
        futures=futures,
        window_blocks=window_blocks,
        written_blocks=written,
        copied_blocks=len(copies),
        held_blocks=stats.held,
        peak_blocks=peak.peak,
        separate_blocks=stats.references,
        block_bytes=cache.block_bytes,
        default_pool_blocks=cache.pool.num_blocks,
    )


def format_runs(runs: list[ForkRun]) -> str:
    header = (
        f"{'K':>3} {'window':>7} {'written/fork':>13} {'copied':>7} {'held':>6} {'held GiB':>9} "
        f"{'separate GiB':>13} {'ratio':>6} {'pool needed GiB':>16} {'default pool GiB':>17}"
    )
    lines = [header]
    for run in runs:
        gib = run.block_bytes / GIB
        written = "/".join(str(w) for w in sorted(set(run.written_blocks)))
        lines.append(
            f"{run.futures:>3} {run.window_blocks:>7} {written:>13} {run.copied_blocks:>7} "
            f"{run.held_blocks:>6} "
            f"{run.held_blocks * gib:>9.2f} {run.separate_blocks * gib:>13.2f} "
            f"{run.held_blocks / run.separate_blocks:>6.2f} {run.peak_blocks * gib:>16.2f} "
            f"{run.default_pool_blocks * gib:>17.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--futures", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--blocks", type=int, default=1, help="blocks each fork generates")
    parser.add_argument("--steps", type=int, default=4, help="denoising forwards per block")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=1560, help="tokens per frame")
    parser.add_argument("--frames-per-block", type=int, default=3)
    parser.add_argument("--sink-frames", type=int, default=9)
    parser.add_argument("--window-frames", type=int, default=9)
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--kv-heads", type=int, default=40)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--kv-format",
        "--kv-dtype",  # the flag's older name
        type=choice(KV_FORMATS),
        default="bf16",
        help=f"the pools' format (PagingConfig(kv_format=...)): {', '.join(KV_FORMATS)}",
    )
    args = parser.parse_args(argv)
    if min(args.futures) < 1 or args.blocks < 0 or args.steps < 0:
        parser.error("--futures must be >= 1, --blocks and --steps >= 0")
    config = PagingConfig(
        block_size=args.block_size,
        chunk_size=args.chunk_size,
        sink_chunks=args.sink_frames,
        window_chunks=args.window_frames,
        max_forward_chunks=args.frames_per_block,
        kv_format=args.kv_format,
    )
    runs = [
        run_forks(
            config,
            futures=k,
            blocks=args.blocks,
            steps=args.steps,
            frames_per_block=args.frames_per_block,
            layers=args.layers,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            dtype=torch.bfloat16,
        )
        for k in args.futures
    ]
    block_gib = runs[0].block_bytes / GIB
    per_sequence = window.blocks_per_sequence(config)
    print(
        f"{args.layers} layers x {args.kv_heads} KV heads x {args.head_dim}, {args.kv_format}, "
        f"C={args.chunk_size} B={args.block_size}, sink {args.sink_frames} + window "
        f"{args.window_frames} frames, {args.frames_per_block} frames per block, both CFG "
        f"branches; one block (every layer, K and V) = {block_gib * 1024:.1f} MiB, one "
        f"session's pool share = {2 * per_sequence * block_gib:.1f} GiB"
    )
    print(
        f"K forks of one session at a full window, each generating {args.blocks} block(s) of "
        f"{args.steps} denoising forwards + 1 commit; blocks over both branches"
    )
    print(format_runs(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
