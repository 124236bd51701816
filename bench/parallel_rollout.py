"""The parallel Wan rollout: bytes each rank moves per forward, and time per block, by layout.

``python -m paged_video.bench.parallel_rollout comm`` runs real rollouts on ``--ranks`` CPU
processes (gloo on 127.0.0.1, the kernels' plain-PyTorch path) for each layout (Ulysses over
every rank, the window sharded over every rank, and both at once when the ranks allow) and each
window length in ``--windows`` (frames), with ``models.distributed.record_traffic`` logging the
real tensors of every collective the rollout issues. It prints, per layout and window, the
bytes one rank receives from the others per forward (by kind: Ulysses all-to-alls, window-shard
gather and exchange, the sequence all-gather after ``proj_out``, the per-forward plan digest)
and its pool bytes, writes them to ``comm.csv`` and plots them to ``comm.png`` under ``--out``.
A layout's traffic is the forward's chunk's, whatever the window: only the pools grow with it
(and the window shards divide them).

``python -m paged_video.bench.parallel_rollout time`` is the multi-GPU half, one process per
GPU under ``torchrun`` (NCCL), e.g. ``for n in 1 2 4 8; do torchrun --standalone
--nproc_per_node=$n -m paged_video.bench.parallel_rollout time --kv-shards $n; done``: each
run generates ``--blocks`` blocks of the Wan 2.1 1.3B shape (``--tiny``: a 2-layer model) with
a window of ``--window`` frames sharded over the ranks and prints rank 0's median time per block
once the window is full (``--csv`` appends the row). Alone on a CPU it runs as a world of one on
gloo; no multi-GPU machine was available to measure it.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from paged_video.bench.wan_rollout import TINY, WAN_1_3B, BlockTimer, Shape, build_model

# The comm bench's model: small enough for CPU ranks, 4 heads so Ulysses can take 4 ranks.
COMM_SHAPE = dataclasses.replace(TINY, heads=4, head_dim=16, sink_frames=1)
BLOCK_SIZE = 16
KINDS = {
    "Ulysses all-to-all (q, k, v)": "ulysses",
    "Ulysses all-to-all (output)": "ulysses",
    "window-shard gather (q, k, v)": "shard gather",
    "window-shard exchange (partial outputs, LSE)": "shard exchange",
    "sequence all-gather": "sequence gather",
    "CFG all-gather": "cfg",
}
COLUMNS = (
    "layout",
    "ranks",
    "window_frames",
    "bytes_per_forward",
    "ulysses",
    "shard_gather",
    "shard_exchange",
    "sequence_gather",
    "digest",
    "pool_bytes_per_rank",
    "single_process_pool_bytes",
)


def layouts(ranks: int) -> dict[str, dict[str, int]]:
    """The layouts compared on ``ranks`` ranks: Ulysses, window shards, and both."""
    out = {"ulysses": {"ulysses_degree": ranks}, "window shards": {"kv_shard_degree": ranks}}
    if ranks % 2 == 0 and ranks > 2:
        out["both"] = {"ulysses_degree": 2, "kv_shard_degree": ranks // 2}
    return out


def _config(shape: Shape, window: int):
    from paged_video.paging import PagingConfig

    return PagingConfig(
        block_size=BLOCK_SIZE,
        chunk_size=shape.tokens_per_frame,
        sink_chunks=shape.sink_frames,
        window_chunks=window,
        max_forward_chunks=shape.frames_per_block,
        exact_window=True,
    )


def traffic_per_forward(log, forwards: int) -> dict[str, float]:
    """Bytes this rank received per forward, by kind (``KINDS``, plan digests as ``digest``);
    the once-per-rollout agreement checks are left out."""
    kinds: dict[str, int] = defaultdict(int)
    for transfer in log:
        if transfer.name.startswith("agreement check"):
            continue
        kind = "digest" if transfer.name.startswith("plan digest") else KINDS[transfer.name]
        kinds[kind.replace(" ", "_")] += transfer.received
    return {kind: total / forwards for kind, total in kinds.items()}


def _comm_rank(rank: int, port: int, world: int, windows: list[int], out_dir: str) -> None:
    """One rank of ``comm``: every layout and window; rank 0 writes ``rank0.csv``."""
    from paged_video.models.distributed import record_traffic
    from paged_video.models.parallel import ParallelLayout, ParallelWanRollout
    from paged_video.paging import PagedKVCache

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    shape = COMM_SHAPE
    model = build_model(shape, torch.device("cpu"))
    rows = []
    for name, degrees in layouts(world).items():
        layout = ParallelLayout(**degrees)
        for window in windows:
            config = _config(shape, window)
            blocks = shape.sink_frames + window + 1  # the window fills, then slides
            g = torch.Generator().manual_seed(1)
            noise = torch.randn(1, shape.channels, blocks, shape.height, shape.width, generator=g)
            text = torch.randn(2, 1, shape.text_tokens, shape.text_dim, generator=g)
            with ParallelWanRollout(model, config, layout) as rollout:
                with record_traffic() as log:
                    rollout.generate(
                        noise,
                        text[0],
                        text[1],
                        frames_per_block=1,
                        sigmas=(1.0,),
                        record_reads=False,
                    )
                pool = rollout.cache.pool_bytes
            single = PagedKVCache(
                config,
                num_layers=shape.layers,
                num_kv_heads=shape.heads,
                head_dim=shape.head_dim,
                branches=("positive", "negative"),
                dtype=shape.dtype,
            ).pool_bytes
            kinds = traffic_per_forward(log, forwards=2 * blocks)
            rows.append(
                {
                    "layout": name,
                    "ranks": world,
                    "window_frames": window,
                    "bytes_per_forward": sum(kinds.values()),
                    **{column: kinds.get(column, 0.0) for column in COLUMNS[4:9]},
                    "pool_bytes_per_rank": pool,
                    "single_process_pool_bytes": single,
                }
            )
    if rank == 0:
        write_csv(Path(out_dir) / "rank0.csv", rows)
    dist.destroy_process_group()


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    """Rows written by ``write_csv``, numbers as floats."""
    with path.open() as f:
        return [
            {k: v if k == "layout" else float(v) for k, v in row.items()}
            for row in csv.DictReader(f)
        ]


def run_comm(ranks: int, windows: list[int]) -> list[dict]:
    """Spawn ``ranks`` CPU processes and return rank 0's rows (see ``COLUMNS``)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # the spawned ranks inherit it: the plain-PyTorch kernels
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            mp.spawn(_comm_rank, args=(port, ranks, windows, out_dir), nprocs=ranks)
            return read_csv(Path(out_dir) / "rank0.csv")
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def format_comm(rows: list[dict]) -> str:
    header = (
        f"{'layout':14s} {'ranks':>5s} {'window':>6s} {'bytes/fwd':>10s} {'ulysses':>9s} "
        f"{'gather':>9s} {'exchange':>9s} {'seq_gath':>9s} {'digest':>7s} {'pool/rank':>10s} "
        f"{'pool 1-proc':>11s}"
    )
    lines = [header]
    for row in rows:
        lines.append(
            f"{row['layout']:14s} {int(row['ranks']):5d} {int(row['window_frames']):6d} "
            f"{row['bytes_per_forward']:10.0f} {row['ulysses']:9.0f} {row['shard_gather']:9.0f} "
            f"{row['shard_exchange']:9.0f} {row['sequence_gather']:9.0f} {row['digest']:7.0f} "
            f"{row['pool_bytes_per_rank']:10.0f} {row['single_process_pool_bytes']:11.0f}"
        )
    return "\n".join(lines)


def plot_comm(rows: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.2))
    traffic, pools = figure.subplots(1, 2)
    for name in dict.fromkeys(row["layout"] for row in rows):
        mine = [row for row in rows if row["layout"] == name]
        windows = [row["window_frames"] for row in mine]
        traffic.plot(windows, [row["bytes_per_forward"] for row in mine], "o-", label=name)
        pools.plot(windows, [row["pool_bytes_per_rank"] for row in mine], "o-", label=name)
    windows = [row["window_frames"] for row in rows if row["layout"] == rows[0]["layout"]]
    singles = [
        row["single_process_pool_bytes"] for row in rows if row["layout"] == rows[0]["layout"]
    ]
    pools.plot(windows, singles, "k--", label="one process")
    ranks = int(rows[0]["ranks"])
    traffic.set_title(f"bytes one rank receives per forward ({ranks} ranks)")
    pools.set_title("KV pool bytes per rank")
    for ax in (traffic, pools):
        ax.set_xlabel("window (frames)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    traffic.set_ylim(bottom=0)
    pools.set_yscale("log")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def run_time(args: argparse.Namespace) -> dict[str, float]:
    """One run of ``time`` on this rank; rank 0's row."""
    from paged_video.models.parallel import ParallelLayout, ParallelWanRollout

    under_torchrun = "RANK" in os.environ
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if under_torchrun:
        dist.init_process_group("nccl" if cuda else "gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        device = torch.device("cpu")
        if cuda:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        shape = TINY if args.tiny else WAN_1_3B
        if args.window:
            shape = dataclasses.replace(shape, window_frames=args.window)
        world = dist.get_world_size()
        cfg = 2 if args.cfg else 1
        layout = ParallelLayout(
            ulysses_degree=args.ulysses,
            cfg_degree=cfg,
            kv_shard_degree=world // (cfg * args.ulysses),
        )
        model = build_model(shape, device)
        config = _config(shape, shape.window_frames)
        g = torch.Generator().manual_seed(1)
        frames = args.blocks * shape.frames_per_block
        noise = torch.randn(1, shape.channels, frames, shape.height, shape.width, generator=g)
        text = torch.randn(2, 1, shape.text_tokens, shape.text_dim, generator=g)
        noise, text = noise.to(device, shape.dtype), text.to(device, shape.dtype)
        sigmas = [1.0 - i / args.steps for i in range(args.steps)]
        timer = BlockTimer(device)
        with ParallelWanRollout(model, config, layout) as rollout:

            def generate(count: int, on_block) -> None:
                f = count * shape.frames_per_block
                rollout.generate(
                    noise[:, :, :f],
                    text[0],
                    text[1],
                    frames_per_block=shape.frames_per_block,
                    sigmas=sigmas,
                    record_reads=False,
                    on_block=on_block,
                )

            generate(1, lambda block: None)  # compiles the kernels
            timer.reset()
            generate(args.blocks, timer)
            pool = rollout.cache.pool_bytes
        full = -(-(shape.sink_frames + shape.window_frames) // shape.frames_per_block)
        steady = timer.times[full:] or timer.times[-1:]
        return {
            "world": world,
            "kv_shards": layout.kv_shard_degree,
            "ulysses": layout.ulysses_degree,
            "cfg": cfg,
            "window_frames": shape.window_frames,
            "steady_block_ms": statistics.median(steady) * 1e3,
            "first_block_ms": timer.times[0] * 1e3,
            "pool_bytes_per_rank": pool,
            "device": str(device.type),
        }
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    comm = commands.add_parser("comm", help="bytes per forward vs window, CPU ranks (gloo)")
    comm.add_argument("--ranks", type=int, default=4, help="CPU processes (default 4)")
    comm.add_argument("--windows", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    comm.add_argument("--out", type=Path, default=None, help="folder for comm.csv and comm.png")
    timing = commands.add_parser("time", help="time per block; under torchrun, one GPU per rank")
    timing.add_argument("--kv-shards", type=int, default=None, help="check: the shard degree")
    timing.add_argument("--ulysses", type=int, default=1)
    timing.add_argument("--cfg", action="store_true", help="CFG parallel (2 branches)")
    timing.add_argument("--tiny", action="store_true", help="a 2-layer model, seconds on a CPU")
    timing.add_argument("--window", type=int, default=None, help="window frames (default 9)")
    timing.add_argument("--blocks", type=int, default=None)
    timing.add_argument("--steps", type=int, default=4)
    timing.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    timing.add_argument("--csv", type=Path, default=None, help="append rank 0's row here")
    args = parser.parse_args(argv)
    if args.command == "comm":
        if args.ranks < 2 or any(w < 1 for w in args.windows):
            parser.error("--ranks must be >= 2 and every window >= 1")
        rows = run_comm(args.ranks, sorted(set(args.windows)))
        print(format_comm(rows))
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            write_csv(args.out / "comm.csv", rows)
            plot_comm(rows, args.out / "comm.png")
        return 0
    args.blocks = args.blocks or (4 if args.tiny else 24)
    row = run_time(args)
    if args.kv_shards is not None and row["kv_shards"] != args.kv_shards:
        parser.error(f"--kv-shards {args.kv_shards} but the world gives {row['kv_shards']}")
    if int(os.environ.get("RANK", 0)) == 0:
        print(
            " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
        )
        if args.csv is not None:
            new = not args.csv.exists()
            with args.csv.open("a", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(row))
                if new:
                    writer.writeheader()
                writer.writerow(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
