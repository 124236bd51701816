"""``python -m paged_video.bench.eight_bit_choice``: which 8-bit format (issue 45) to build, by
float64 emulation alone (``reference.eight_bit_attention``; no kernel runs, so a CPU takes
minutes).

Every ``bench accuracy`` data kind (bf16-rounded, the same generator and geometry), every
candidate: rel L1 against float64 attention, beside today's pools' float64 emulations
(``reference.quantized_attention``: the e4m3 and int8 pools dequantizing, FP8-MMA, INT8-MMA).
As the cache does, K is smoothed by the first frame's mean, int8 K equalized by factors chosen
from that frame (e4m3 K is not), and frozen V scales come from that frame too. A ``/regrow``
candidate's K factors regrow frame by frame where a frame's are 4x wider (``reference.regrow``:
K written a frame at a time, the codes stored before restated), as the cache's do; today's
int8 pools are ``bench accuracy``'s floors, so their K and V factors regrow too.

Candidates are named ``K/V/P/accumulator`` (``CANDIDATES``): K ``int8``/``e4m3`` per ``slot`` or
per ``tile64``; V ``frozen16`` (per channel frozen at the first write with headroom 16),
``block64`` (per channel per block of 64 keys), ``slot`` (today's row scale, into each
probability) or ``bf16`` (16-bit V); P ``e4m3`` (at 448), ``exact``, ``bf16``/``fp16``;
accumulator ``acc13`` (Hopper's FP8 MMA), ``acc22``, ``exact``, with ``flushN`` (every N tiles of
64 keys). The accurate format ending ``/unrounded-q``, ``-k`` or ``-qk`` leaves those operands'
codes unrounded: which rounding its error comes from. ``k8v8`` and ``k8v8/regrow``: k8v8 as it
ships (``reference.eight_bit_attention.K8V8_FORMAT``: V's channel scales frozen at headroom 256,
128-key tiles). Goals (issue 45): the fast format <=
``FAST_RANDOM_GOAL`` on random data and on every kind <= ``FAST_VS_E4M3`` x today's e4m3 pool;
the accurate one <= ``ACCURATE_GOAL`` everywhere.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from paged_video.bench import accuracy
from paged_video.bench.accuracy import AccuracyConfig, Data, Prepared, Variant
from paged_video.bench.results import sig3
from paged_video.kernels.equalize import K_SHARE, choose_factors
from paged_video.reference import eight_bit_attention as eba

E4M3 = torch.float8_e4m3fn
FAST_RANDOM_GOAL = 0.04
FAST_VS_E4M3 = 1.1
ACCURATE_GOAL = 0.015
# Query rows per emulation call (a multiple of every candidate's rows per Q scale).
ROWS_PER_CALL = 64


@dataclass(frozen=True)
class Candidate:
    """A format, whether K is equalized, K's share of the channels' width, whether K's factors
    regrow after the first write (``reference.regrow``; else frozen there) and which operands'
    codes are left unrounded (``"q"``, ``"k"``: an error budget, no format a kernel runs).
    Smoothing is always on, as the cache's default."""

    format: eba.EightBitFormat
    equalize_k: bool = True
    k_share: float = K_SHARE
    regrow: bool = False
    unrounded: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.regrow and not self.equalize_k:
            raise ValueError("regrow needs equalize_k: only equalization factors regrow")
        if not self.unrounded <= {"q", "k"}:
            raise ValueError(f"unrounded names operands 'q' and 'k', got {sorted(self.unrounded)}")
        if self.regrow and "k" in self.unrounded:
            # Regrowth restates the stored codes, rounding them again.
            raise ValueError("regrow rounds K's codes: it cannot leave them unrounded")


def _fmt(k: str, v: str, p: str = "e4m3", acc: str = "acc13", flush: int = 1) -> Candidate:
    k_dtype, k_scales = k.split("-")
    fields: dict[str, object] = {
        "k_dtype": torch.int8 if k_dtype == "int8" else E4M3,
        "k_keys_per_scale": 1 if k_scales == "slot" else int(k_scales.removeprefix("tile")),
        "p_dtype": {"e4m3": E4M3, "exact": None, "bf16": torch.bfloat16, "fp16": torch.float16}[p],
        "acc_bits": None if acc == "exact" else int(acc.removeprefix("acc")),
        "flush_tiles": flush,
    }
    if v.startswith("frozen"):
        fields |= {"v_scales": "frozen", "v_headroom": float(v.removeprefix("frozen"))}
    elif v.startswith("block"):
        fields |= {"v_scales": "block", "v_keys_per_scale": int(v.removeprefix("block"))}
    else:
        fields["v_scales"] = "none" if v == "bf16" else v
    return Candidate(eba.EightBitFormat(**fields), equalize_k=k_dtype == "int8")


def _name(k: str, v: str, p: str = "e4m3", acc: str = "acc13", flush: int = 1) -> str:
    return f"{k}/{v}/{p}/{acc}" + (f"/flush{flush}" if flush != 1 else "")


def candidates() -> dict[str, Candidate]:
    """The grid: K x V at P e4m3, acc13, flush 1; then P, normalizer, accumulator and flush
    around int8 per slot; the accurate formats (16-bit V); frozen K choices switched off;
    k8v8 as it ships."""
    grid = [
        (k, v)
        for k in ("int8-slot", "e4m3-slot", "int8-tile64", "e4m3-tile64")
        for v in ("frozen16", "frozen64", "frozen256", "block64", "block256", "slot")
    ]
    specs: list[tuple] = [(k, v) for k, v in grid]
    for v in ("frozen16", "block64"):
        specs += [("int8-slot", v, "exact"), ("int8-slot", v, "e4m3", "exact")]
        specs += [("int8-slot", v, "e4m3", "acc22")]
    specs += [("int8-slot", "frozen256", "e4m3", "acc13", f) for f in (2, 4, 8)]
    specs += [("int8-slot", "block256", "e4m3", "acc13", f) for f in (2, 4)]
    specs += [("int8-slot", "bf16", p, "exact") for p in ("bf16", "fp16")]
    specs += [("int8-tile64", "bf16", "fp16", "exact")]
    out = {_name(*spec): _fmt(*spec) for spec in specs}
    for name in ("int8-slot/frozen16/e4m3/acc13", "int8-slot/block64/e4m3/acc13"):
        rounded = replace(out[name].format, normalizer="rounded")
        out[name + "/rounded-sum"] = Candidate(rounded)
        out[name + "/no-equalize"] = Candidate(out[name].format, equalize_k=False)
    # Q scaled per row (free in the kernel too: a per-row factor joins the softmax scale) and
    # other splits of K's outlier width between K and q.
    for name in ("int8-slot/block64/e4m3/acc13", "int8-slot/bf16/bf16/exact"):
        per_row = replace(out[name].format, q_rows_per_scale=1)
        if per_row.p_dtype == E4M3:
            # The fast format as k8v8's kernel sums it: the rounded P, by the P V MMA.
            per_row = replace(per_row, normalizer="rounded")
        out[name + "/q-row"] = Candidate(per_row)
        for share in (0.25, 1.0):
            out[f"{name}/q-row/k-share{share:g}"] = Candidate(per_row, k_share=share)
        # K's factors regrow where a later frame's are 4x or more (the cache's rule).
        out[name + "/q-row/regrow"] = Candidate(per_row, regrow=True)
    # The accurate format's error budget: which rounding its error comes from.
    accurate = out["int8-slot/bf16/bf16/exact/q-row"]
    for operands in ("q", "k", "qk"):
        unrounded = frozenset(operands)
        out[f"int8-slot/bf16/bf16/exact/q-row/unrounded-{operands}"] = replace(
            accurate, unrounded=unrounded
        )
    # k8v8 as it ships, its K factors frozen or regrowing (the cache's).
    out["k8v8"] = Candidate(eba.K8V8_FORMAT)
    out["k8v8/regrow"] = Candidate(eba.K8V8_FORMAT, regrow=True)
    return out


# Today's pools: (format, mode, equalized), K smoothed.
TODAY = {
    "today e4m3 pool": (accuracy.E4M3_POOL, "dequant", False),
    "today FP8-MMA": (accuracy.E4M3_POOL, "fp8-mma", False),
    "today int8 pool": ("int8", "dequant", True),
    "today INT8-MMA": ("int8", "int8-mma", True),
}
E4M3_POOL = "today e4m3 pool"


def emulate(candidate: Candidate, data: Data, prepared: Prepared, first_write: int) -> torch.Tensor:
    """Float64 output of ``candidate`` on ``data`` (K smoothed, int8 K equalized, V frozen from
    the first ``first_write`` keys; K written ``first_write`` keys a frame, as the cache
    writes)."""
    fmt = candidate.format
    keys, k_factor = stored_keys(candidate, data.keys, prepared.mean, first_write)
    queries = eba.quantize_queries(data.q, fmt, k_factor, rounded="q" not in candidate.unrounded)
    values = eba.quantize_values(data.values, fmt, first_write)
    return eba.attend_codes_by_rows(queries, keys, values, fmt, ROWS_PER_CALL)


def stored_keys(
    candidate: Candidate, keys: torch.Tensor, mean: torch.Tensor, frame: int
) -> tuple[eba.Codes, torch.Tensor | None]:
    """K's codes as the cache stores ``keys`` written ``frame`` keys at a time (minus ``mean``),
    and the factors they are stored under (None: K not equalized): chosen by the first frame,
    then frozen or, for a ``regrow`` candidate, regrown by each later frame
    (``bench.accuracy.written_rows``)."""
    fmt = candidate.format
    rounded = "k" not in candidate.unrounded
    if not candidate.equalize_k:
        return eba.quantize_keys(keys, fmt, smooth=mean, rounded=rounded), None

    def choose(rows: torch.Tensor) -> torch.Tensor:
        return choose_factors(rows, mean, share=candidate.k_share)

    def quantize(rows: torch.Tensor, factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return eba.quantize_keys(rows, fmt, smooth=mean, factor=factor, rounded=rounded)

    if not candidate.regrow:
        factor = choose(keys[:frame])
        return quantize(keys, factor), factor
    if frame % fmt.k_keys_per_scale:
        raise ValueError(
            f"a regrowing K is written {frame} keys a frame: a multiple of its "
            f"{fmt.k_keys_per_scale} keys per scale"
        )
    replayed = accuracy.written_rows(keys, frame, quantize, smooth=mean, share=candidate.k_share)
    return eba.Codes(replayed.codes, replayed.scale), replayed.factor


def emulate_today(
    name: str, data: Data, prepared: Prepared, config: AccuracyConfig
) -> torch.Tensor:
    """Float64 output of today's pool ``name``: ``bench accuracy``'s floor of it, K smoothed (the
    rows its write stores, frame by frame: equalized int8 factors regrow)."""
    pool, mode, equalize = TODAY[name]
    variant = Variant(pool, mode, smooth=True, equalize=equalize)
    return accuracy.floor_output(variant, data, prepared, config)


def measure(
    config: AccuracyConfig,
    chosen: dict[str, Candidate],
    *,
    log: bool = False,
) -> dict[str, dict[str, float]]:
    """``{row name: {data kind: rel L1}}``: today's pools, then every candidate."""
    table: dict[str, dict[str, float]] = {name: {} for name in (*TODAY, *chosen)}
    for kind in config.data:
        data = accuracy.make_data(kind, config)
        expected = accuracy.reference_output(data)
        prepared = accuracy.prepare(data, config)
        for name in TODAY:
            out = emulate_today(name, data, prepared, config)
            table[name][kind] = accuracy.metrics(out, expected).rel_l1
        for name, candidate in chosen.items():
            out = emulate(candidate, data, prepared, config.chunk_size)
            table[name][kind] = accuracy.metrics(out, expected).rel_l1
        if log:
            print(f"{kind} done", file=sys.stderr, flush=True)
    return table


def verdicts(table: dict[str, dict[str, float]]) -> dict[str, str]:
    """Per candidate: ``fast`` where it meets the fast format's goals, ``accurate`` where it
    meets the accurate one's, ``-`` otherwise (on the kinds measured)."""
    e4m3 = table[E4M3_POOL]
    out = {}
    for name, row in table.items():
        if name in TODAY:
            continue
        goals = []
        if row.get("random", 0.0) <= FAST_RANDOM_GOAL and all(
            row[kind] <= FAST_VS_E4M3 * e4m3[kind] for kind in row
        ):
            goals.append("fast")
        if all(value <= ACCURATE_GOAL for value in row.values()):
            goals.append("accurate")
        out[name] = " ".join(goals) or "-"
    return out


def format_table(table: dict[str, dict[str, float]], *, markdown: bool = False) -> str:
    """Rows of rel L1 (percent, 3 figures) per data kind, and each candidate's verdict."""
    kinds = list(next(iter(table.values())))
    verdict = verdicts(table)
    header = ["format", *kinds, "meets"]
    body = [
        [name, *(f"{sig3(100 * row[k])}" for k in kinds), verdict.get(name, "")]
        for name, row in table.items()
    ]
    if not markdown:
        widths = [max(len(line[i]) for line in (header, *body)) for i in range(len(header))]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True))
            for line in (header, *body)
        )
    lines = [header, ["---"] * len(header), *body]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paged_video.bench.eight_bit_choice")
    parser.add_argument("--queries", type=int, default=128, help="query rows (default 128)")
    parser.add_argument(
        "--heads", type=int, default=1, help="heads (default 1; each adds its own outlier channels)"
    )
    parser.add_argument("--window-chunks", type=int, default=9, help="window frames (default 9)")
    parser.add_argument("--sink-chunks", type=int, default=9, help="sink frames (default 9)")
    parser.add_argument(
        "--data", nargs="+", default=accuracy.DATA_KINDS, choices=accuracy.DATA_KINDS
    )
    parser.add_argument("--only", nargs="+", help="candidate names to run (default all)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    every = candidates()
    unknown = set(args.only or ()) - set(every)
    if unknown:
        parser.error(f"--only: unknown candidates {sorted(unknown)}; known: {sorted(every)}")
    chosen = {n: c for n, c in every.items() if not args.only or n in args.only}
    config = AccuracyConfig(
        heads=args.heads,
        q_rows=args.queries,
        sink_chunks=args.sink_chunks,
        window_chunks=args.window_chunks,
        data=tuple(args.data),
        seed=args.seed,
    )
    print(
        f"rel L1 (%) against float64 attention: {config.rows} queries over {config.kv_tokens} "
        f"keys, {config.heads} head(s) of {config.head_dim}, bf16-rounded data "
        f"(seed {config.seed}); float64 emulations, no kernels"
    )
    print(format_table(measure(config, chosen, log=True), markdown=args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
