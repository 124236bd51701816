"""Host cost of ``ForwardPlan.prepare()`` at the shipped geometry, early and deep in a rollout.

``python -m paged_video.bench.prepare_timing`` rolls one session forward (one committing
forward of 3
frames per tick) and times ``prepare()`` of a scratch and of a committing forward at tick 10
and tick 1000. With compaction the block table stays bounded, so both ticks should cost the
same. ``prepare`` does not depend on heads or layers; the cache uses the shipped 40 x 128 bf16
for realism (its memory is allocated, never touched, on a CPU).

It times with ``--threads`` torch threads (default 1, printed): ``prepare`` runs small torch
ops, which a second thread only slows down on a busy machine (each op waits for a core). It
prints the median and the minimum of ``--repeats`` calls.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from paged_video.bench.timing import torch_threads
from paged_video.paging import PagedKVCache, PagingConfig

SHIPPED = PagingConfig(
    block_size=16, chunk_size=1560, sink_chunks=9, window_chunks=9, max_forward_chunks=3
)
FORWARD_TOKENS = 3 * 1560


def time_prepare(
    cache: PagedKVCache, session, *, commit: bool, repeats: int
) -> tuple[float, float]:
    """Median and minimum milliseconds of ``prepare()`` of a fresh plan; committing ones are
    cancelled."""
    samples = []
    for _ in range(repeats):
        plan = cache.plan(session, "main", FORWARD_TOKENS, commit=commit)
        start = time.perf_counter()
        plan.prepare()
        if cache.device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
        plan.cancel()
    return statistics.median(samples), min(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m paged_video.bench.prepare_timing", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--ticks", type=int, nargs="+", default=[10, 1000])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1, help="torch threads while timing")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    args = parser.parse_args(argv)
    for name in ("repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if any(tick < 0 for tick in args.ticks):
        parser.error(f"--ticks must be >= 0, got {args.ticks}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")

    cache = PagedKVCache(SHIPPED, num_layers=1, num_kv_heads=40, head_dim=128, device=args.device)
    session = cache.open_session()
    sequence = session.sequences["main"]
    tick = 0
    print(
        f"shipped geometry: C=1560 B=16 sink 9 window 9, 3 frames/forward, {args.device}, "
        f"{args.threads} torch thread{'s' if args.threads > 1 else ''}, "
        f"{args.repeats} calls each (median / min ms)"
    )
    print("tick  table_entries  scratch_prepare_ms  committing_prepare_ms")
    with torch_threads(args.threads):
        for target in sorted(args.ticks):
            while tick < target:
                plan = cache.plan(session, "main", FORWARD_TOKENS, commit=True)
                plan.prepare()
                plan.commit()
                tick += 1
            scratch = time_prepare(cache, session, commit=False, repeats=args.repeats)
            committing = time_prepare(cache, session, commit=True, repeats=args.repeats)
            print(
                f"{tick:4d}  {len(sequence.block_table):13d}  {scratch[0]:8.3f} / "
                f"{scratch[1]:7.3f}  {committing[0]:11.3f} / {committing[1]:7.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
