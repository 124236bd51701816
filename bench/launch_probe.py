"""A GPU probe of launch settings the launch table does not offer: this project's attention at
the shipped geometry under a forced tile, warp count and stage count, each run checked against
the sweep's oracle before it is timed (a wrong one is reported, never timed).

    python -m paged_video.bench.launch_probe --block-sizes 64,1560 \\
        --providers triton,triton-int8 --configs 128x64w8s3,64x64w4s2 --out DIR

A config ``MxNwWsS`` is a ``M x N`` tile, ``W`` warps, ``S`` stages; ``default`` is the
launcher's own choice. Suffixes: ``+wide`` (``default+wide``, ``128x64w8s3+wide``) makes the
quantized modes read their scale columns the wide way (``kernels/_attention_jit._load_scales``:
fewer instructions and copies, more barriers) instead of as plain prefetched loads; ``+bits``
makes k8v8's and k8v16's 64-key loops (and k8v8's 128-key one) take their int32 scores to float
by an integer add (``_biased_scores``: no ``I2FP``, whose pipe may be the exponentials') instead
of a conversion; ``+tma`` or
``+cp_async`` forces the key loop (``+tma`` where the tile lies inside a block and the pools
are ones a descriptor reads; any other run is reported, not timed). ``--runs
PROVIDER@CONFIG,...`` names the runs one by one, in order, instead of every provider with every
config. It answers "would another launch be faster" inside a GPU window: a quantized winner
becomes a launch-table row through ``bench choose --probe`` (not a ``+wide`` or ``+bits`` one,
nor one at another query tile than the table's: the table holds none), a 16-bit one through a
sweep of the launch providers and ``bench choose``. Rows go to ``DIR/probe.csv`` (long format: each
with its K/V mode, the launch that ran, the device, versions and commit).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import inspect
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from paged_video.bench.cli import PRESETS, _geometries
from paged_video.bench.providers import PROVIDERS, Provider, launch_backend
from paged_video.bench.results import provenance
from paged_video.bench.sweep import WrongResultError, _check_then_time, _Oracles
from paged_video.bench.timing import TimingSettings, figures_kind
from paged_video.bench.workload import Geometry, make_workload

_CONFIG = re.compile(r"^(?:(\d+)x(\d+)w(\d+)s(\d+)|default)(\+wide)?(\+bits)?(\+tma|\+cp_async)?$")


@dataclass(frozen=True)
class Launch:
    """A forced launch; tile, warps and stages None: the launcher's own."""

    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    wide_scales: bool = False
    score_bits: bool = False
    variant: str | None = None

    def __str__(self) -> str:
        if self.block_m is None:
            text = "default"
        else:
            text = f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}"
        text += "+wide" if self.wide_scales else ""
        text += "+bits" if self.score_bits else ""
        return text + (f"+{self.variant}" if self.variant else "")


def parse_launch(text: str) -> Launch:
    """``MxNwWsS`` or ``default``, optionally ``+wide``, then ``+bits``, then ``+tma`` or
    ``+cp_async``; raises ``ValueError`` naming the text otherwise."""
    match = _CONFIG.match(text)
    if match is None:
        raise ValueError(
            "a config is MxNwWsS (e.g. 128x64w8s3) or 'default', optionally +wide, then +bits, "
            f"then +tma or +cp_async, got {text!r}"
        )
    *sizes, wide, bits, variant = match.groups()
    numbers = [int(n) for n in sizes] if sizes[0] is not None else [None] * 4
    return Launch(
        *numbers,
        wide_scales=wide is not None,
        score_bits=bits is not None,
        variant=variant[1:] if variant else None,
    )


def parse_runs(text: str) -> list[tuple[str, Launch]]:
    """``PROVIDER@CONFIG,...`` as (provider, launch) pairs; raises ``ValueError`` naming a bad
    pair."""
    runs = []
    for pair in text.split(","):
        provider, at, config = pair.partition("@")
        if not at or not provider:
            raise ValueError(f"a run is PROVIDER@CONFIG (e.g. triton@default), got {pair!r}")
        attention_provider(provider)
        runs.append((provider, parse_launch(config)))
    return runs


@contextlib.contextmanager
def forced(launch: Launch) -> Iterator[list[dict]]:
    """``paged_attention`` launches with ``launch``'s warps and stages (and its tile), its key
    path and variant chosen for that tile as usual, and its way of reading scales. Yields the
    launches made under it, as ``providers.launch_backend`` settings plus the launch table's
    ``mode`` the launcher looked up (None: no row): what ran, which a row records."""
    module = sys.modules["paged_video.kernels.paged_attention"]
    original = module.choose_tiles
    # choose_tiles' arguments that name the launch table's mode.
    mode_arguments = inspect.signature(module.table_mode).parameters
    launched: list[dict] = []

    def choose(**kwargs: object) -> dict:
        if launch.block_m is not None:
            kwargs.update(block_m=launch.block_m, block_n=launch.block_n)
        if launch.variant is not None:
            kwargs.update(variant=launch.variant)
        tiles = original(**kwargs)
        tma_ready = bool(kwargs.get("tma_ready", True))
        if launch.variant == "tma" and not tiles["TMA"]:
            raise ValueError(f"{launch}: no tile of this key path lies inside one block")
        if launch.variant == "tma" and not tma_ready:
            # The launcher would quietly run the pointer loop.
            raise ValueError(f"{launch}: no descriptor reads these pools (kernels.keys_major)")
        if launch.block_m is not None:
            tiles.update(num_warps=launch.num_warps, num_stages=launch.num_stages)
        if launch.wide_scales:
            tiles["WIDE_SCALES"] = True
        if launch.score_bits:
            tiles["SCORE_BITS"] = True
        tma = tiles["TMA"] and tma_ready  # the launcher's own fallback, as it will run
        launched.append(
            {
                "variant": tiles["VARIANT"] if tma else "cp_async",
                "tile": f"{tiles['BLOCK_M']}x{tiles['BLOCK_N']}",
                "num_warps": tiles["num_warps"],
                "num_stages": tiles["num_stages"],
                "tma": "on" if tma else "off",
                "ahead": "on" if tiles["SCORES_AHEAD"] else "off",
                "mode": module.table_mode(**{k: kwargs[k] for k in mode_arguments if k in kwargs}),
            }
        )
        return tiles

    module.choose_tiles = choose
    try:
        yield launched
    finally:
        module.choose_tiles = original


def attention_provider(name: str) -> Provider:
    """The sweep's ``paged_attention`` provider ``name`` (ours: bf16 or a quantized pool)."""
    for provider in PROVIDERS:
        if provider.kernel == "paged_attention" and provider.name == name:
            return provider
    raise ValueError(f"no paged_attention provider {name!r}")


def shipped_geometry() -> Geometry:
    """The sweep's ``--preset shipped`` geometry (it has one)."""
    return preset_geometry("shipped")


def preset_geometry(name: str) -> Geometry:
    """The first geometry of the sweep's ``--preset NAME``; the small one at 16 tokens a chunk
    (as ``bench/gpu_check.sh --dry-run`` sweeps it) with fp16 queries, so that each run names
    its launch-table mode as a GPU run's bf16 ones do (float32 calls have no row)."""
    settings = dict(PRESETS[name])
    if name != "shipped":
        settings.update(chunk_sizes=(16,), dtypes=("fp16",))
    return _geometries(argparse.ArgumentParser(), settings)[0]


COLUMNS = (
    "provider", "mode", "head_dim", "block_size", "launch", "backend", "ms", "tflops",
    "max_error", "error_limit", "outcome", "figures", "device", "torch", "triton", "commit",
    "timestamp",
)  # fmt: skip


def every_pair(providers: Sequence[str], launches: Sequence[Launch]) -> list[tuple[str, Launch]]:
    """Every provider with every launch, provider by provider."""
    return [(provider, launch) for provider in providers for launch in launches]


def probe(
    runs: Sequence[tuple[str, Launch]],
    block_sizes: Sequence[int],
    out: Path,
    *,
    time_limit_s: float | None = None,
    geometry: Geometry | None = None,
    device: str = "cuda",
) -> list[dict]:
    """Check then time every (provider, launch) of ``runs`` at every block size, in order,
    writing ``out/probe.csv``; ``geometry`` defaults to the shipped one (a test passes a tiny
    one and the CPU)."""
    device = torch.device(device)
    shared = provenance(device, figures_kind(device))
    geometry = geometry or shipped_geometry()
    oracles, settings = _Oracles(), TimingSettings()
    chosen = [(attention_provider(name), launch) for name, launch in runs]
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    started = time.monotonic()
    with open(out / "probe.csv", "w", newline="") as stream:
        writer = csv.DictWriter(stream, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for block_size in block_sizes:
            workload = make_workload(geometry, block_size, device=device)
            for provider, launch in chosen:
                row = {"provider": provider.name, "head_dim": geometry.head_dim, **shared}
                row.update(block_size=block_size, launch=str(launch))
                if time_limit_s and time.monotonic() - started > time_limit_s:
                    row["outcome"] = "not run: time limit"
                else:
                    row.update(_run_one(provider, launch, workload, oracles, settings))
                writer.writerow(row)
                stream.flush()
                rows.append(row)
                print(_line(row), flush=True)
            del workload
    return rows


def _run_one(provider, launch, workload, oracles, settings) -> dict:
    try:
        with forced(launch) as launched:
            checked = _check_then_time(
                provider, None, workload, oracles, workload.q.device, settings
            )
    except WrongResultError as error:
        return {"outcome": f"WRONG: {str(error)[-160:]}"}
    except Exception as error:  # a launch that cannot run (shared memory, registers): say why
        return {"outcome": f"failed: {type(error).__name__}: {str(error)[:160]}"}
    if isinstance(checked, str):
        return {"outcome": checked}
    ran = launched[-1]
    ms = checked.timing.p50_ms
    return {
        "mode": ran["mode"] or "",
        "backend": launch_backend(ran),
        "ms": round(ms, 4),
        "tflops": round(workload.geometry.attention_flops() / ms / 1e9, 1),
        "max_error": checked.error,
        "error_limit": checked.limit,
        "outcome": "ok",
    }


def _line(row: dict) -> str:
    figures = f"{row['ms']:.3f} ms {row['tflops']:.0f} TFLOP/s" if "ms" in row else ""
    return (
        f"{row['provider']:<18} B{row['block_size']:<5} {row['launch']:<14} {figures:<24}"
        f" {row.get('outcome', '')}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--providers", default="triton")
    parser.add_argument("--block-sizes", default="64")
    parser.add_argument("--configs", default="default")
    parser.add_argument("--runs", default=None, help="PROVIDER@CONFIG,... instead of the two above")
    parser.add_argument("--time-limit", type=float, default=None)
    parser.add_argument("--out", type=Path, default=Path("out/probe"))
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="shipped",
        help="the geometry (small: bench/gpu_check.sh --dry-run's, with --device cpu)",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("launch_probe: no CUDA device", file=sys.stderr)
        return 2
    try:
        if args.runs is not None:
            runs = parse_runs(args.runs)
        else:
            launches = [parse_launch(text) for text in args.configs.split(",")]
            providers = args.providers.split(",")
            for name in providers:
                attention_provider(name)
            runs = every_pair(providers, launches)
    except ValueError as error:
        parser.error(str(error))
    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    geometry = shipped_geometry() if args.preset == "shipped" else preset_geometry(args.preset)
    probe(
        runs, block_sizes, args.out, time_limit_s=args.time_limit, geometry=geometry,
        device=args.device,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
