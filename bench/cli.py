"""``python -m bench sweep|plot|table|compile``: run a checked sweep, redraw its plots, print a
table, or compile the kernels for a GPU target and report on the machine code."""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bench import compile_report
from bench.plot import plot_rows
from bench.providers import PROVIDER_NAMES, Tile  # importing the kernels picks the interpreter
from bench.results import KERNELS, read_rows
from bench.sweep import SweepConfig, WrongResultError, run_sweep
from bench.table import format_pivot, format_table
from bench.timing import TimingSettings
from bench.workload import DTYPES, Geometry

# The shipped model: 40 heads of 128, bf16, 1560-token frames, 3 frames per forward, sink 9
# frames and window 9 frames (4680 queries over 28080 keys).
PRESETS: dict[str, dict[str, object]] = {
    "shipped": {
        "block_sizes": (8, 16, 24, 32, 64, 128, 256, 520, 1560),
        "chunk_sizes": (1560,),
        "frames": 3,
        "sink_chunks": (9,),
        "window_chunks": (9,),
        "heads": (40,),
        "gqa_groups": (1,),
        "head_dims": (128,),
        "dtypes": ("bf16",),
        "batch": 1,
    },
    # Small enough for the Triton interpreter: the whole sweep takes seconds on a CPU.
    "small": {
        "block_sizes": (8, 16, 24, 32, 64, 128),
        "chunk_sizes": (40,),
        "frames": 2,
        "sink_chunks": (1,),
        "window_chunks": (3,),
        "heads": (4,),
        "gqa_groups": (2,),
        "head_dims": (32,),
        "dtypes": ("fp32",),
        "batch": 1,
    },
}
# Above this many attention FLOPs per call a CPU run (the interpreter) would take hours.
CPU_FLOP_LIMIT = 2e10


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _list_of(parse: Callable[[str], object]) -> Callable[[str], tuple[object, ...]]:
    def parse_list(text: str) -> tuple[object, ...]:
        items = [item.strip() for item in text.split(",")]
        if not all(items):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return tuple(dict.fromkeys(parse(item) for item in items))

    return parse_list


def _choice(allowed: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in allowed:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(allowed)}")
        return text

    return parse


def _tile(text: str) -> Tile | None:
    if text == "auto":
        return None
    sizes = text.lower().split("x")
    if len(sizes) == 2 and all(s.isdigit() for s in sizes):
        block_m, block_n = (int(s) for s in sizes)
        if all(v >= 16 and v & (v - 1) == 0 for v in (block_m, block_n)):
            return Tile(block_m, block_n)
    raise argparse.ArgumentTypeError(
        f"expected 'auto' or BLOCK_MxBLOCK_N with powers of two >= 16 (e.g. 64x32), got {text!r}"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    sweep = commands.add_parser(
        "sweep",
        help="run a sweep: check every provider against the oracle, time it, write CSV + plots",
        description="Lists are comma-separated; every list of the geometry is swept (product). "
        "Options left out take the preset's value.",
    )
    sweep.add_argument("--preset", choices=sorted(PRESETS), default="shipped")
    sweep.add_argument("--out", type=Path, default=Path("out"), help="folder for CSV and PNGs")
    sweep.add_argument(
        "--kernels",
        type=_list_of(_choice(KERNELS)),
        default=KERNELS,
        help=f"kernels to run (default: all): {', '.join(KERNELS)}",
    )
    sweep.add_argument(
        "--providers",
        type=_list_of(_choice(PROVIDER_NAMES)),
        help=f"providers to run (default: all that apply): {', '.join(PROVIDER_NAMES)}",
    )
    ints = _list_of(_positive_int)
    sweep.add_argument("--block-sizes", type=ints, help="tokens per cache block")
    sweep.add_argument("--chunk-sizes", type=ints, help="tokens per frame (C)")
    sweep.add_argument("--frames", type=_positive_int, help="frames per forward (queries = F*C)")
    sweep.add_argument("--sink-chunks", type=_list_of(_non_negative_int), help="sink frames")
    sweep.add_argument("--window-chunks", type=ints, help="recent frames kept, own frames included")
    sweep.add_argument("--heads", type=ints, help="query heads")
    sweep.add_argument("--gqa-groups", type=ints, help="query heads per KV head")
    sweep.add_argument("--head-dims", type=ints)
    sweep.add_argument("--dtypes", type=_list_of(_choice(tuple(DTYPES))))
    sweep.add_argument("--batch", type=_positive_int, help="sequences per call")
    sweep.add_argument(
        "--tiles",
        type=_list_of(_tile),
        default=(None,),
        help="Triton attention tiles: auto (the launcher's choice) or BLOCK_MxBLOCK_N",
    )
    sweep.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    sweep.add_argument("--seed", type=_non_negative_int, default=0)
    sweep.add_argument("--rep-ms", type=_positive_int, default=100, help="do_bench rep (GPU)")
    sweep.add_argument("--cpu-reps", type=_positive_int, default=3, help="timed calls on a CPU")
    sweep.add_argument("--no-plot", action="store_true", help="write the CSV only")
    sweep.add_argument("--no-progress", action="store_true", help="no progress bar")

    plot = commands.add_parser("plot", help="draw the PNGs of a results CSV")
    plot.add_argument("csv", type=Path)
    plot.add_argument("--out", type=Path, help="folder for the PNGs (default: the CSV's)")

    table = commands.add_parser("table", help="print the table of a results CSV")
    table.add_argument("csv", type=Path)
    table.add_argument(
        "--pivot", action="store_true", help="short form: block sizes down, providers across"
    )
    compile_report.add_parser(
        commands, _list_of(_positive_int), lambda names: _list_of(_choice(names))
    )
    return parser


def _resolve_device(parser: argparse.ArgumentParser, requested: str) -> str:
    if requested == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    if requested != "auto":
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def _geometries(parser: argparse.ArgumentParser, settings: dict[str, object]) -> list[Geometry]:
    frames = settings["frames"]
    for window in settings["window_chunks"]:
        if window < frames:
            parser.error(
                f"--window-chunks {window} is below --frames {frames}: "
                "the window includes the forward's own frames"
            )
    for heads, group in itertools.product(settings["heads"], settings["gqa_groups"]):
        if heads % group:
            parser.error(f"--gqa-groups {group} does not divide --heads {heads}")
    for head_dim in settings["head_dims"]:
        if head_dim > 256:
            parser.error(f"--head-dims {head_dim}: the kernels take head_dim up to 256")
    return [
        Geometry(
            chunk_size=chunk,
            frames=frames,
            sink_chunks=sink,
            window_chunks=window,
            heads=heads,
            kv_heads=heads // group,
            head_dim=head_dim,
            dtype=dtype,
            batch=settings["batch"],
        )
        for chunk, sink, window, heads, group, head_dim, dtype in itertools.product(
            settings["chunk_sizes"],
            settings["sink_chunks"],
            settings["window_chunks"],
            settings["heads"],
            settings["gqa_groups"],
            settings["head_dims"],
            settings["dtypes"],
        )
    ]


def _run_sweep(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    settings = {
        name: getattr(args, name) if getattr(args, name) is not None else preset_value
        for name, preset_value in PRESETS[args.preset].items()
    }
    geometries = _geometries(parser, settings)
    device = _resolve_device(parser, args.device)
    largest = max(g.attention_flops() for g in geometries)
    if device == "cpu" and largest > CPU_FLOP_LIMIT:
        parser.error(
            f"--preset {args.preset}: {largest:.2g} FLOP per attention call is far too much for "
            "a CPU run; use --preset small or smaller --chunk-sizes, "
            "--heads, --head-dims"
        )
    config = SweepConfig(
        geometries=tuple(geometries),
        block_sizes=settings["block_sizes"],
        kernels=args.kernels,
        providers=args.providers,
        tiles=args.tiles,
        device=device,
        seed=args.seed,
        timing=TimingSettings(rep_ms=args.rep_ms, cpu_reps=args.cpu_reps),
    )
    try:
        result = run_sweep(config, args.out / "sweep.csv", progress=not args.no_progress)
    except WrongResultError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(format_table(result.rows))
    reasons: dict[tuple[str, str, str], list[int]] = {}
    for skip in result.skipped:
        reasons.setdefault((skip.kernel, skip.provider, skip.reason), []).append(skip.block_size)
    for (kernel, provider, reason), block_sizes in reasons.items():
        print(f"skipped {kernel}/{provider} (block sizes {block_sizes}): {reason}")
    print(f"wrote {result.csv_path}")
    if not args.no_plot:
        for path in plot_rows(result.rows, args.out):
            print(f"wrote {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "sweep":
        return _run_sweep(parser, args)
    if args.command == "compile":
        return compile_report.run(parser, args)
    if not args.csv.is_file():
        parser.error(f"csv: no such file {args.csv}")
    try:
        rows = read_rows(args.csv)
    except ValueError as error:
        parser.error(f"csv: {error}")
    if args.command == "plot":
        for path in plot_rows(rows, args.out or args.csv.parent):
            print(f"wrote {path}")
    else:
        print(format_pivot(rows) if args.pivot else format_table(rows))
    return 0
