"""``python -m paged_video.bench sweep|plot|table|compare|compile|accuracy|choose``: run a
checked sweep, redraw its plots, print its ratio table, compare two runs, compile the kernels for
a GPU target and report on the machine code, measure the accuracy of quantized (FP8/INT8) KV
pools, or turn a GPU sweep of the launch providers into the launch table.

Each subcommand is a pair: ``_add_<name>(commands)`` declares it and sets its handler (and
itself as ``command_parser``, for errors), ``_<name>(parser, args) -> exit status`` runs it;
``SUBCOMMANDS`` lists the declarations.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import torch

from paged_video.bench import accuracy, choose, compile_report, extras
from paged_video.bench.compare import format_compare
from paged_video.bench.formats import choice
from paged_video.bench.plot import plot_rows
from paged_video.bench.providers import (  # importing the kernels picks the interpreter
    PROVIDER_NAMES,
    Tile,
)
from paged_video.bench.results import KERNELS, Row, read_rows
from paged_video.bench.sweep import SweepConfig, WrongResultError, run_sweep
from paged_video.bench.table import format_pivot, format_ratios, format_table, skip_lines
from paged_video.bench.timing import TimingSettings
from paged_video.bench.workload import DTYPES, Geometry

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
# Heads of `bench accuracy` on a CPU by default: one takes ~2.5 CPU-minutes under the interpreter.
CPU_ACCURACY_HEADS = 1
# `bench accuracy`'s geometries: `shipped` (the default) is the shipped model's attention, one
# frame of 1560 queries over sink 9 + window 9 frames (about half an hour of CPU for one head
# under the interpreter); `small` attends 256 queries over 4 frames of 256 keys (about a minute).
ACCURACY_PRESETS: dict[str, dict[str, int | None]] = {
    "shipped": {
        "head_dim": 128,
        "chunk_size": 1560,
        "sink_chunks": 9,
        "window_chunks": 9,
        "queries": None,
        "block_size": 1560,
    },
    "small": {
        "head_dim": 128,
        "chunk_size": 256,
        "sink_chunks": 1,
        "window_chunks": 3,
        "queries": None,
        "block_size": 256,
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


DEVICE_HELP = "auto (default): cuda when a GPU is visible, else cpu (Triton's interpreter)"
SEED_HELP = "seed of the random data (default 0): the same seed, the same data"

_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _list_of(parse: Callable[[str], object]) -> Callable[[str], tuple[object, ...]]:
    def parse_list(text: str) -> tuple[object, ...]:
        items = [item.strip() for item in text.split(",")]
        if not all(items):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return tuple(dict.fromkeys(parse(item) for item in items))

    return parse_list


def _switch(text: str) -> tuple[object, ...]:
    """``off``, ``on`` or ``both`` (also the list ``off,on``): the settings rows run with."""
    if text == "both":
        return ("off", "on")
    if not set(text.split(",")) <= {"off", "on"}:
        raise argparse.ArgumentTypeError(f"expected off, on or both, got {text!r}")
    return _list_of(choice(("off", "on")))(text)


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


def _add_sweep(commands: argparse._SubParsersAction) -> None:
    sweep = commands.add_parser(
        "sweep",
        help="run a sweep: check every provider against the oracle, time it, write CSV + plots",
        description="Lists are comma-separated; every list of the geometry is swept (product), "
        "block sizes in the order given. Options left out take the preset's value.",
    )
    sweep.set_defaults(handler=_sweep, command_parser=sweep)
    sweep.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="shipped",
        help="geometry defaults: shipped (the model's; refused on a CPU) or small (under a "
        "minute of CPU)",
    )
    sweep.add_argument("--out", type=Path, default=Path("out"), help="folder for CSV and PNGs")
    sweep.add_argument(
        "--kernels",
        type=_list_of(choice(KERNELS)),
        default=KERNELS,
        help=f"kernels to run (default: all): {', '.join(KERNELS)}",
    )
    sweep.add_argument(
        "--providers",
        type=_list_of(choice(PROVIDER_NAMES)),
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
    sweep.add_argument("--head-dims", type=ints, help="channels per head")
    sweep.add_argument(
        "--dtypes",
        type=_list_of(choice(tuple(DTYPES))),
        help=f"query and K/V dtypes: {', '.join(DTYPES)} (the interpreter gets bf16 wrong: fp32 "
        "on a CPU)",
    )
    sweep.add_argument("--batch", type=_positive_int, help="sequences per call")
    sweep.add_argument(
        "--tiles",
        type=_list_of(_tile),
        default=(None,),
        help="Triton attention tiles: auto (the launcher's choice) or BLOCK_MxBLOCK_N",
    )
    sweep.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help=DEVICE_HELP
    )
    sweep.add_argument("--seed", type=_non_negative_int, default=0, help=SEED_HELP)
    sweep.add_argument("--rep-ms", type=_positive_int, default=100, help="do_bench rep (GPU)")
    sweep.add_argument(
        "--cpu-reps",
        type=_positive_int,
        default=TimingSettings.cpu_reps,
        help="timed calls on a CPU (a CPU row is judged by their minimum)",
    )
    sweep.add_argument(
        "--cpu-threads",
        type=_positive_int,
        default=TimingSettings.cpu_threads,
        help="torch threads while timing on a CPU (more stall on a busy machine)",
    )
    sweep.add_argument(
        "--time-limit",
        type=_positive_int,
        help="seconds after which no new run starts (the rest are reported skipped); the "
        "end-of-run ceilings are still measured",
    )
    sweep.add_argument("--no-plot", action="store_true", help="write the CSV only")
    sweep.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_plot(commands: argparse._SubParsersAction) -> None:
    plot = commands.add_parser("plot", help="draw the PNGs of a results CSV")
    plot.set_defaults(handler=_plot, command_parser=plot)
    plot.add_argument("csv", type=Path)
    plot.add_argument("--out", type=Path, help="folder for the PNGs (default: the CSV's folder)")


def _add_table(commands: argparse._SubParsersAction) -> None:
    table = commands.add_parser(
        "table",
        help="print a results CSV: per (kernel, block size), ours against the fastest baseline",
    )
    table.set_defaults(handler=_table, command_parser=table)
    table.add_argument("csv", type=Path)
    table.add_argument("--goal", action="store_true", help="mark the rows below 1.0x")
    form = table.add_mutually_exclusive_group()
    form.add_argument("--long", action="store_true", help="every measured row instead")
    form.add_argument(
        "--pivot", action="store_true", help="throughput: block sizes down, providers across"
    )


def _add_compare(commands: argparse._SubParsersAction) -> None:
    compare = commands.add_parser(
        "compare",
        help="per case of two results CSVs: new/old medians, a change only where the p20-p80 "
        "ranges do not overlap",
    )
    compare.set_defaults(handler=_compare, command_parser=compare)
    compare.add_argument("old", type=Path, help="results CSV before the change")
    compare.add_argument("new", type=Path, help="results CSV after the change")


def _add_compile(commands: argparse._SubParsersAction) -> None:
    compile_parser = compile_report.add_parser(
        commands, _list_of(_positive_int), lambda names: _list_of(choice(names))
    )
    compile_parser.set_defaults(handler=compile_report.run, command_parser=compile_parser)


def _add_accuracy(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "accuracy",
        help="quantized KV pools (FP8/INT8) against float64 attention on bf16 K/V: cosine, "
        "relative L1, the format's float64 floor, the goal",
        description="Every row writes K/V with write_slots and attends with paged_attention "
        "(the Triton interpreter on a CPU). Defaults: the shipped geometry (one frame of 1560 "
        "queries over sink 9 + window 9 frames of 1560 keys, head_dim 128) with "
        f"{CPU_ACCURACY_HEADS} head on a CPU and all {accuracy.SHIPPED_HEADS} on a GPU: on a "
        "CPU that is about half an hour; --preset small (256 queries over 4 frames of 256 "
        "keys) takes about a minute. Options given override the preset's values.",
    )
    parser.set_defaults(handler=_accuracy, command_parser=parser)
    parser.add_argument(
        "--preset",
        choices=sorted(ACCURACY_PRESETS),
        default="shipped",
        help="geometry: shipped (default; ~30 CPU-minutes) or small (~1 CPU-minute)",
    )
    parser.add_argument("--out", type=Path, default=Path("out"), help="folder for accuracy.csv")
    parser.add_argument(
        "--data",
        type=_list_of(choice(accuracy.DATA_KINDS)),
        default=accuracy.DATA_KINDS,
        help=f"data kinds: {', '.join(accuracy.DATA_KINDS)}",
    )
    parser.add_argument(
        "--formats",
        type=_list_of(choice(accuracy.FORMAT_CHOICES)),
        default=tuple(accuracy.FORMATS),
        help="quantized pool formats (the bf16 baseline always runs): int8; k8v8 (int8 K, e4m3 "
        "V per channel), k8v16 (int8 K, 16-bit V) (the e4m3 pool was deleted, issue 45)",
    )
    parser.add_argument(
        "--smoothing",
        type=_switch,
        default=("off", "on"),
        help="K smoothing: off, on or both (default: both)",
    )
    parser.add_argument(
        "--equalize",
        type=_switch,
        default=("off", "on"),
        help="channel equalization of K and V: off, on or both (default: both)",
    )
    parser.add_argument("--heads", type=_positive_int, help="default: 1 on a CPU, 40 on a GPU")
    parser.add_argument("--head-dim", type=_positive_int, help="channels per head (128)")
    parser.add_argument("--chunk-size", type=_positive_int, help="tokens per frame")
    parser.add_argument("--sink-chunks", type=_non_negative_int, help="sink frames")
    parser.add_argument("--window-chunks", type=_positive_int, help="window frames")
    parser.add_argument(
        "--queries", type=_positive_int, help="attend only the frame's first QUERIES queries"
    )
    parser.add_argument("--block-size", type=_positive_int, help="tokens per cache block")
    parser.add_argument(
        "--dtype",
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help="queries and the bf16 baseline pool: bf16 on a GPU, fp32 (holding the same "
        "bf16-rounded values) on a CPU by default",
    )
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help=DEVICE_HELP
    )
    parser.add_argument("--seed", type=_non_negative_int, default=0, help=SEED_HELP)
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")


def _add_choose(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "choose",
        help="the launch table from GPU sweeps of the launch providers and launch probes of "
        "the quantized modes: print the winners, optionally write them",
    )
    parser.set_defaults(handler=_choose, command_parser=parser)
    parser.add_argument("csv", type=Path, nargs="*", help="results CSVs of one GPU run")
    parser.add_argument(
        "--probe",
        type=Path,
        action="append",
        default=[],
        help="a bench.launch_probe CSV of the same run (the quantized rows); repeatable",
    )
    parser.add_argument(
        "--write", type=Path, help="launch table to update (e.g. kernels/launch_choices.json)"
    )
    parser.add_argument(
        "--rehearsal",
        action="store_true",
        help="take CPU figures too (bench/gpu_check.sh --dry-run); never --write the shipped table",
    )


SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_sweep,
    _add_plot,
    _add_table,
    _add_compare,
    _add_compile,
    _add_accuracy,
    _add_choose,
)


class OneLineParser(argparse.ArgumentParser):
    """A parser whose refusal is one line, the error itself and where the usage is (argparse
    prints the whole usage first: 19 lines before the error); exit 2, a usage error."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (usage: {self.prog} --help)\n")


# Exit statuses (docs/benchmarks.md): a bad argument is refused before any work; an error while
# working (a file that cannot be written, a wrong result, a missing optional package) ends it.
USAGE_ERROR = 2
RUN_ERROR = 1


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m paged_video.bench", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(commands)
    return parser


def _out_folder(parser: argparse.ArgumentParser, out: Path, inside: str) -> None:
    """Make the ``--out`` folder before any work, or refuse in one line: every subcommand's
    ``--out`` is a folder, and ``inside`` says what goes in it."""
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out}: is a file; --out takes a folder ({inside})")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"--out {out}: cannot create the folder: {error.strerror or error}")


def _rows_of(
    parser: argparse.ArgumentParser, name: str, path: Path, *, skipped: bool = False
) -> list[Row]:
    """The rows of the results CSV ``path``, or a one-line error naming the argument."""
    if not path.exists():
        parser.error(f"{name} {path}: no such file")
    try:
        return read_rows(path, skipped=skipped)
    except (ValueError, OSError, UnicodeDecodeError) as error:
        parser.error(f"{name}: {error}")


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


def _sweep(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
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
    if not args.no_plot:
        extras.require("matplotlib.figure", "the sweep's plots (--no-plot writes the CSV only)")
    _out_folder(parser, args.out, "the CSV and the PNGs go inside")
    config = SweepConfig(
        geometries=tuple(geometries),
        block_sizes=settings["block_sizes"],
        kernels=args.kernels,
        providers=args.providers,
        tiles=args.tiles,
        device=device,
        seed=args.seed,
        timing=TimingSettings(
            rep_ms=args.rep_ms, cpu_reps=args.cpu_reps, cpu_threads=args.cpu_threads
        ),
        time_limit_s=args.time_limit,
    )
    wrong = None
    try:
        result = run_sweep(config, args.out / "sweep.csv", progress=not args.no_progress)
    except WrongResultError as error:
        if error.result is None:
            print(f"error: {error}", file=sys.stderr)
            return 1
        result, wrong = error.result, error
    print(format_table(result.rows))
    skipped = [{**vars(skip), "skipped": skip.reason} for skip in result.skipped]
    for line in skip_lines(skipped):
        print(line)
    print()
    print(format_ratios(result.rows))
    print(f"wrote {result.csv_path}")
    if not args.no_plot:
        for path in plot_rows(result.rows, args.out):
            print(f"wrote {path}")
    if wrong is not None:
        # Last, so a GPU log's tail shows it: the figures above never include a wrong run.
        print(f"error: {wrong}", file=sys.stderr)
        return 1
    return 0


def _plot(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    extras.require("matplotlib.figure", "plots")
    rows = _rows_of(parser, "csv", args.csv)
    out = args.out or args.csv.parent
    _out_folder(parser, out, "the PNGs go inside")
    for path in plot_rows(rows, out):
        print(f"wrote {path}")
    return 0


def _table(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    rows = _rows_of(parser, "csv", args.csv, skipped=True)
    if args.long:
        print(format_table(rows))
    elif args.pivot:
        print(format_pivot(rows))
    else:
        print(format_ratios(rows, goal=args.goal))
    return 0


def _compare(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    old = _rows_of(parser, "old", args.old)
    new = _rows_of(parser, "new", args.new)
    print(format_compare(old, new))
    return 0


def _accuracy(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    for name, preset_value in ACCURACY_PRESETS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, preset_value)
    device = _resolve_device(parser, args.device)
    if args.head_dim > 256:
        parser.error(f"--head-dim {args.head_dim}: the kernels take head_dim up to 256")
    _out_folder(parser, args.out, "accuracy.csv goes inside")
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
    heads = args.heads or (accuracy.SHIPPED_HEADS if device == "cuda" else CPU_ACCURACY_HEADS)
    config = accuracy.AccuracyConfig(
        heads=heads,
        head_dim=args.head_dim,
        chunk_size=args.chunk_size,
        sink_chunks=args.sink_chunks,
        window_chunks=args.window_chunks,
        q_rows=args.queries,
        block_size=args.block_size,
        data=args.data,
        formats=args.formats,
        smoothing=tuple(choice == "on" for choice in args.smoothing),
        equalizing=tuple(choice == "on" for choice in args.equalize),
        q_dtype=DTYPES[dtype],
        device=device,
        seed=args.seed,
    )
    for line in accuracy.describe(config):
        print(line)
    csv_path = args.out / "accuracy.csv"
    rows = accuracy.run_accuracy(config, csv_path, log=accuracy.print_progress)
    print(accuracy.format_rows(rows, markdown=args.markdown))
    print(f"wrote {csv_path}")
    return 0


def _choose(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Choose from each source given; write what was chosen, and fail (exit 1, after writing)
    where one source could not choose: a GPU window's probe must not be lost to its sweep."""
    if not args.csv and not args.probe:
        parser.error("give a sweep CSV, a --probe CSV, or both")
    rows = [row for path in args.csv for row in _rows_of(parser, "csv", path)]
    for path in args.probe:
        if not path.is_file():
            parser.error(f"--probe {path}: no such file")
    if args.write is not None and not args.write.is_file():
        parser.error(f"--write {args.write}: no such launch table")
    shipped = choose.launch_table.TABLE_PATH.resolve()
    if args.rehearsal and args.write is not None and args.write.resolve() == shipped:
        parser.error("--rehearsal chooses from figures that are no speed: --write a copy")
    try:
        probed = [row for path in args.probe for row in choose.read_probe(path)]
    except ValueError as error:
        parser.error(f"--probe: {error}")
    choices, lines, errors = [], [], []
    for name, source, choose_from in (
        ("csv", rows, choose.choose),
        ("--probe", probed, choose.choose_quantized),
    ):
        if source:
            try:
                chosen, shown = choose_from(source, rehearsal=args.rehearsal)
            except ValueError as error:
                errors.append(f"{name}: {error}")
                continue
            choices, lines = [*choices, *chosen], [*lines, *shown]
    if not choices:
        parser.error("; ".join(errors) or f"nothing to choose: {'; '.join(lines)}")
    try:
        if args.write is not None:
            choose.write_choices(args.write, choices)
    except ValueError as error:
        parser.error(str(error))
    print("\n".join(lines))
    for row in choices:
        print(
            f"head_dim {row['head_dim']} {row['kv_path']} {row['mode']}: {row['variant']} "
            f"block_n={row['block_n']} warps={row['num_warps']} stages={row['num_stages']}"
        )
    if args.write is not None:
        print(f"wrote {args.write}")
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    return 1 if errors else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; an error reading or writing a file, or a missing optional package
    (the ``bench`` extra's matplotlib), ends it in one line (exit 1)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args.command_parser, args)
    except extras.MissingExtraError as error:
        print(f"error: {error}", file=sys.stderr)
        return RUN_ERROR
    except OSError as error:
        where = f"{error.filename}: " if error.filename else ""
        print(f"error: {where}{error.strerror or error}", file=sys.stderr)
        return RUN_ERROR
