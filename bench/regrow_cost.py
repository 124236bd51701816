"""``python -m paged_video.bench.regrow_cost``: what the equalization factors' regrowth check
costs a write (``kernels.regrow``).

Every write of a layer whose factors are chosen runs the check: one pass over its rows (one
program per KV head) and a rescale launch whose programs exit where no head grew. Timed here
per quantized format (``int8``, ``k8v8``, ``k8v16``) as ``write_slots`` of one frame into a
one-layer ``PagedKVCache``'s pools, with the layer's flag set (the check runs: ``checked``)
and with the same factors passed without it (no check: ``frozen``), beside the check alone
(``check``: ``regrown_factors`` and the rescale over the layer's pool, nothing growing).
Shipped geometry by default (a 1,560-token frame, 40 KV heads of 128, bf16, the shipped
window); ``--preset small`` is a CPU smoke run whose figures say nothing of speed. Prints a
table; ``--out DIR`` writes ``regrow_cost.csv`` (long format: one row per format and case,
with the device, versions, commit and timestamp).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from paged_video import kernels
from paged_video.bench.results import provenance, sig3
from paged_video.bench.timing import TimingSettings, figures_kind, measure
from paged_video.kernels import equalize, regrow
from paged_video.paging import PagedKVCache, PagingConfig

FORMATS = ("int8", "k8v8", "k8v16")
CASES = ("frozen", "checked", "check")
PRESETS = {
    "shipped": {"frame": 1560, "kv_heads": 40, "head_dim": 128, "block": 1560, "window": 9},
    "small": {"frame": 64, "kv_heads": 2, "head_dim": 32, "block": 16, "window": 2},
}
COLUMNS = ("format", "case", "ms", "frame", "kv_heads", "head_dim", "block_size")


@dataclasses.dataclass(frozen=True)
class Setup:
    """One format's layer, written once (its factors chosen), and the next frame's rows."""

    cache: PagedKVCache
    key: torch.Tensor
    value: torch.Tensor
    slots: torch.Tensor


def _setup(kv_format: str, shape: dict[str, int], device: torch.device, dtype) -> Setup:
    config = PagingConfig(
        block_size=shape["block"],
        chunk_size=shape["frame"],
        sink_chunks=1,
        window_chunks=shape["window"],
        kv_format=kv_format,
    )
    cache = PagedKVCache(
        config,
        num_layers=1,
        num_kv_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        dtype=dtype,
        device=device,
    )
    gen = torch.Generator().manual_seed(0)
    rows = (2 * shape["frame"], shape["kv_heads"], shape["head_dim"])
    key, value = (torch.randn(rows, generator=gen).to(device, dtype) for _ in range(2))
    slots = torch.arange(rows[0], device=device)
    first = slice(0, shape["frame"])
    layer = cache.layer(0)
    kernels.write_slots(
        key[first], value[first], *layer.write_pools, slots[first], **layer.write_kwargs()
    )
    later = slice(shape["frame"], None)
    return Setup(cache, key[later], value[later], slots[later])


def cases(setup: Setup) -> dict[str, Callable[[], object]]:
    """The timed calls: the write with and without the check, and the check alone."""
    layer = setup.cache.layer(0)
    pools = layer.write_pools
    checked = layer.write_kwargs()
    frozen = {name: t for name, t in checked.items() if name != "equalizers_chosen"}
    k_pool, factor = pools[0], checked["k_equalizer"]

    def write(kwargs: dict) -> Callable[[], object]:
        return lambda: kernels.write_slots(
            setup.key, setup.value, *pools, setup.slots, **kwargs, check_values=False
        )

    def check() -> None:
        new, grown = regrow.regrown_factors(
            factor, setup.key, checked.get("k_smooth"), setup.slots, equalize.K_SHARE
        )
        regrow.regrow_codes(k_pool, factor, new, grown)

    return {"frozen": write(frozen), "checked": write(checked), "check": check}


def measure_all(
    formats: Sequence[str], shape: dict[str, int], device: torch.device, dtype
) -> list[dict[str, object]]:
    """One row per format and case (milliseconds per call: the median on a GPU, the minimum on
    a CPU); nothing may grow, which each format's factors after the runs confirm."""
    settings = TimingSettings(cpu_reps=3)
    rows = []
    for kv_format in formats:
        setup = _setup(kv_format, shape, device, dtype)
        chosen = setup.cache.k_equalizers.clone()
        for case, fn in cases(setup).items():
            fn()  # warm-up (compiles)
            timing = measure(fn, device, settings)
            rows.append(
                {
                    "format": kv_format,
                    "case": case,
                    "ms": timing.headline(device),
                    "frame": shape["frame"],
                    "kv_heads": shape["kv_heads"],
                    "head_dim": shape["head_dim"],
                    "block_size": shape["block"],
                }
            )
        if not torch.equal(setup.cache.k_equalizers, chosen):
            raise RuntimeError(f"{kv_format}: the factors regrew on rows of the same kind")
    return rows


def format_table(rows: list[dict[str, object]]) -> str:
    """Per format: the three cases' milliseconds and the check's share of the checked write."""
    lines = ["format  frozen ms  checked ms  check ms  check / checked"]
    for kv_format in dict.fromkeys(r["format"] for r in rows):
        ms = {r["case"]: float(r["ms"]) for r in rows if r["format"] == kv_format}
        share = ms["check"] / ms["checked"] if ms["checked"] > 0 else float("nan")
        lines.append(
            f"{kv_format:6}  {sig3(ms['frozen']):>9}  {sig3(ms['checked']):>10}  "
            f"{sig3(ms['check']):>8}  {sig3(share):>15}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paged_video.bench.regrow_cost")
    parser.add_argument("--preset", choices=list(PRESETS), default="shipped")
    parser.add_argument(
        "--formats", default=",".join(FORMATS), help="comma list of " + ", ".join(FORMATS)
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, help="folder for regrow_cost.csv")
    args = parser.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:
        parser.error(f"--formats: {unknown or 'none given'}; known: {', '.join(FORMATS)}")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = PRESETS[args.preset]
    rows = measure_all(formats, shape, device, dtype)
    figures = figures_kind(device)
    print(f"the regrowth check per write ({figures}; {shape}):")
    print(format_table(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        shared = provenance(device, figures)
        with open(args.out / "regrow_cost.csv", "w", newline="") as stream:
            writer = csv.DictWriter(stream, fieldnames=(*COLUMNS, *shared))
            writer.writeheader()
            for row in rows:
                writer.writerow(row | shared)
        print(f"wrote {args.out / 'regrow_cost.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
