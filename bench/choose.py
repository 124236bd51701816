"""``python -m paged_video.bench choose [SWEEP.csv ...] [--probe PROBE.csv ...] [--write TABLE]``:
the launch table from a GPU run.

A sweep that names the launch providers (``LAUNCH_PROVIDERS``: this project's kernel at one
variant and key tile each) times every launch at every block size. Per (head_dim class, key
path at the built-in tile) the winner is the launch with the smallest geometric mean, over the
block sizes measured for that class, of its time over the fastest launch's at the same block
size (a launch missing at one of them does not compete, and a class where every launch misses
one, as in a run cut short, keeps its row; ties go to the first in ``LAUNCH_PROVIDERS``), and
its row names the winner's own variant and key tile (a block where the launcher fell back to
the pointer loop does not decide the variant). A launch is weighed as a table row would run
it: ``triton-tma-n128`` at block 64 runs the loop over tiles of two whole blocks, which the
launcher takes only when the caller names the variant, so there it counts at the pointer
loop's time (``triton-cp_async-n128``'s; the table prints its own, marked ``(pairs)``). The
winner table prints every block size: each launch's time, the winner, ``sdpa-best`` and the
winner's speedup over it, and the quantized providers' speedup over ``sdpa-best``.

The quantized rows come from ``bench.launch_probe``'s CSV (``--probe``): its runs over quantized
pools, each row naming the K/V mode and the launch that ran (``backend``), grouped by (head_dim
class, key path, mode); the winner is chosen the same way among the launches measured at every
block size of the class, where at least two are (a launch probed twice, e.g. as ``default``
and by its settings, counts at its faster time; a class with less keeps its row).

``--write`` replaces the table's rows of the classes chosen (source ``gpu run``, with the run's
date, device and commit) and keeps the others.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

from paged_video.bench.providers import LAUNCH_PROVIDERS, QUANTIZED_PROVIDERS, SDPA_BEST
from paged_video.bench.results import Row, headline_ms
from paged_video.kernels import launch_table
from paged_video.kernels.paged_attention import table_block_m, table_key, two_block_tiles

_BACKEND = re.compile(
    r"variant=(?P<variant>\w+) tile=\d+x(?P<block_n>\d+) warps=(?P<num_warps>\d+) "
    r"stages=(?P<num_stages>\d+)(?: tma=\w+)?(?: ahead=(?P<ahead>on|off))?"
)
_TILE_M = re.compile(r"tile=(\d+)x")


def launch_of(row: Row) -> dict[str, object]:
    """The launch a launch provider's row ran, read from its ``backend``."""
    match = _BACKEND.search(str(row.get("backend") or ""))
    if not match:
        raise ValueError(f"{row['provider']}: backend {row.get('backend')!r} names no launch")
    fields = match.groupdict()
    # (Rows of runs before the scores-ahead loop existed name no ``ahead``: theirs was off.)
    ahead = fields.pop("ahead") == "on"
    launch = {k: int(v) if v.isdigit() else v for k, v in fields.items()}
    return {**launch, "scores_ahead": ahead}


def _requested_launch(name: str, rows: Sequence[Row]) -> dict[str, object]:
    """The launch provider ``name``'s own variant and key tile, with the warps and stages of a
    row that ran that variant (at some block sizes of a class the launcher falls back to the
    pointer loop, e.g. a 128-key TMA tile over 24-slot blocks: the table must still name the
    variant that won where it applies)."""
    requested = LAUNCH_PROVIDERS[name]
    launches = [launch_of(row) for row in rows]
    ran = [launch for launch in launches if launch["variant"] == requested["variant"]]
    # (scores_ahead comes from the provider: a launch falls back to the pointer loop, not off
    # the scores-ahead loop.)
    return {**(ran or launches)[0], **requested}


def _pair_loop(row: Row, block: int) -> bool:
    """Whether a launch provider's row ran the loop over tiles of two whole blocks (``tma`` on
    the rows path), which the launcher takes only where the caller names the variant: a table
    row reads those tiles by pointer (``paged_attention.two_block_tiles``)."""
    launch = launch_of(row)
    return launch["variant"] == "tma" and two_block_tiles(block, int(launch["block_n"]))


def _table_ms(name: str, block: int, rows: dict[str, Row]) -> float | None:
    """The time at ``block`` of the launch a table row naming provider ``name``'s launch runs:
    the provider's, but for the pair loop the pointer loop's at the same tile (its ``cp_async``
    twin's; None where that did not run)."""
    if not _pair_loop(rows[name], block):
        return headline_ms(rows[name])
    pointers = {**LAUNCH_PROVIDERS[name], "variant": "cp_async"}
    twin = next((n for n, launch in LAUNCH_PROVIDERS.items() if launch == pointers), None)
    return headline_ms(rows[twin]) if twin in rows else None


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _winner(
    names: Sequence[str], cases: Sequence[dict[str, float]]
) -> tuple[str, dict[str, float]] | None:
    """Of ``names``, the one with the smallest geometric mean over ``cases`` (per block size,
    each name's milliseconds) of its time over the fastest at that block size, among those
    measured at every block size (ties: the first in ``names``), with those names' means; None
    where no name is measured at every block size."""
    ratios: dict[str, list[float]] = {name: [] for name in names}
    for measured in cases:
        if not measured:  # nothing a table row would run was measured here
            continue
        fastest = min(measured.values())
        for name in names:
            if name in measured:
                ratios[name].append(measured[name] / fastest)
    means = {n: _geomean(v) for n, v in ratios.items() if len(v) == len(cases)}
    if not means:
        return None
    return min(means, key=means.__getitem__), means


def choose(rows: Sequence[Row], *, rehearsal: bool = False) -> tuple[list[dict], list[str]]:
    """The winning launch per (head_dim class, key path) of a sweep's 16-bit attention rows, and
    the winner table's lines, ending with the launches measured that no row picked.
    ``rehearsal``: CPU figures are taken too (``bench/gpu_check.sh --dry-run``: the choice of a
    run that judges no speed, written only into a copy of the table)."""
    attention = [r for r in rows if r.get("kernel") == "paged_attention" and not r.get("skipped")]
    launches = [r for r in attention if r["provider"] in LAUNCH_PROVIDERS]
    if not launches:
        raise ValueError(f"no rows of the launch providers ({', '.join(LAUNCH_PROVIDERS)})")
    figures = {str(r.get("figures")) for r in launches}
    if figures != {"gpu"} and not rehearsal:
        raise ValueError(f"launch rows have {'/'.join(sorted(figures))} figures; a GPU run only")
    geometry = lambda r: (r["head_dim"], r["dtype"], r["heads"], r["kv_heads"], r["q_tokens"])
    by_case: dict[tuple, dict[str, Row]] = {}
    for row in attention:
        by_case.setdefault((*geometry(row), row["block_size"]), {})[row["provider"]] = row
    classes: dict[tuple, list[tuple]] = {}
    for case in sorted(by_case):
        if any(p in LAUNCH_PROVIDERS for p in by_case[case]):
            head_dim, dtype, block = case[0], case[1], case[-1]
            classes.setdefault((*table_key(block, head_dim), dtype), []).append(case)
    choices, lines, winners = [], [], []
    header = ["hd", "path", "block", *LAUNCH_PROVIDERS, "winner", SDPA_BEST, "vs sdpa"]
    header += list(QUANTIZED_PROVIDERS)
    lines.append(" | ".join(header))
    for (dim_class, path, dtype), cases in sorted(classes.items()):
        # Each launch weighed as a table row would run it (the pair loop as the pointer loop).
        times = [
            {
                n: ms
                for n in by_case[case]
                if n in LAUNCH_PROVIDERS and (ms := _table_ms(n, case[-1], by_case[case]))
            }
            for case in cases
        ]
        chosen = _winner(list(LAUNCH_PROVIDERS), times)
        if chosen is None:  # a run cut short: this class keeps its row
            lines.append(f"head_dim {dim_class} {path}: no launch measured at every block size")
            continue
        winner, means = chosen
        winners.append(winner)
        for case in cases:
            lines.append(_line(dim_class, path, case, by_case[case], winner))
        first = by_case[cases[0]][winner]
        choices.append(
            {
                "head_dim": dim_class,
                "kv_path": path,
                "mode": "same",
                **_requested_launch(winner, [by_case[case][winner] for case in cases]),
                "source": "gpu run",
                "date": str(first.get("timestamp") or "")[:10],
                "device": str(first.get("device") or ""),
                "commit": str(first.get("commit") or ""),
                "evidence": f"{dtype} bench sweep, geometric mean of time over the fastest launch "
                f"at blocks {', '.join(str(c[-1]) for c in cases)}: "
                + ", ".join(f"{n} {mean:.3f}" for n, mean in means.items()),
            }
        )
    if not choices:
        raise ValueError("no class has a launch measured at every one of its block sizes")
    measured = {r["provider"] for r in launches}
    lines.append(not_picked("launch providers", measured, set(winners)))
    return choices, lines


def not_picked(what: str, measured: set[str], picked: set[str]) -> str:
    """The line naming what was measured and won no row: after a GPU run, what goes (with its
    tests and table rows; its figures stay in bench/RESULTS.md)."""
    losers = sorted(measured - picked)
    return f"not picked by any row ({what}): {', '.join(losers) if losers else 'none'}"


def _line(dim_class: int, path: str, case: tuple, rows: dict[str, Row], winner: str) -> str:
    def ms(name: str) -> str:
        if name not in rows:
            return "-"
        pairs = name in LAUNCH_PROVIDERS and _pair_loop(rows[name], case[-1])
        return f"{headline_ms(rows[name]):.3f}" + (" (pairs)" if pairs else "")

    best = rows.get(SDPA_BEST)
    table_ms = _table_ms(winner, case[-1], rows) if winner in rows else None
    speedup = f"{headline_ms(best) / table_ms:.2f}x" if best and table_ms else "-"
    quantized = [
        f"{headline_ms(best) / headline_ms(rows[n]):.2f}x" if best and n in rows else "-"
        for n in QUANTIZED_PROVIDERS
    ]
    cells = [str(dim_class), path, str(case[-1]), *map(ms, LAUNCH_PROVIDERS), winner]
    return " | ".join([*cells, ms(SDPA_BEST), speedup, *quantized])


# What a probe row needs for a choice (``bench.launch_probe.COLUMNS`` writes them).
PROBE_COLUMNS = (
    "provider", "mode", "head_dim", "block_size", "backend", "ms", "outcome", "figures",
)  # fmt: skip


def read_probe(path: Path) -> list[dict]:
    """The rows of a ``bench.launch_probe`` CSV; ``ValueError`` where it is not one."""
    with open(path, newline="") as stream:
        reader = csv.DictReader(stream)
        missing = [c for c in PROBE_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: not a launch_probe CSV (no column {missing[0]!r})")
        return list(reader)


def _launch_label(launch: dict[str, object]) -> str:
    return (
        f"{launch['variant']} n{launch['block_n']} w{launch['num_warps']} s{launch['num_stages']}"
    )


def choose_quantized(
    rows: Sequence[dict], *, rehearsal: bool = False
) -> tuple[list[dict], list[str]]:
    """The winning launch per (head_dim class, key path, quantized mode) of a launch probe's
    rows, where at least two launches were compared, and the lines that show it, ending with
    the launches compared that no row picked (``rehearsal``: as ``choose``)."""
    ran = [r for r in rows if r["outcome"] == "ok" and r["mode"] not in ("", "same")]
    if not ran:
        return [], ["launch probe: no quantized run was checked and timed"]
    figures = {r["figures"] for r in ran}
    if figures != {"gpu"} and not rehearsal:
        raise ValueError(f"probe rows have {'/'.join(sorted(figures))} figures; a GPU run only")
    classes: dict[tuple, dict[int, dict[str, float]]] = {}
    launches: dict[str, dict[str, object]] = {}
    lines = []
    for row in ran:
        head_dim, block = int(row["head_dim"]), int(row["block_size"])
        launch = launch_of(row)
        # The table names no query tile, no way of reading scales and no way of converting
        # scores: a launch at another tile, reading them wide or with the score bits, is not a
        # row it can hold.
        if int(_TILE_M.search(row["backend"])[1]) != table_block_m(head_dim):
            lines.append(f"{row['provider']} {row['launch']}: another query tile, not a choice")
            continue
        if "+wide" in row["launch"]:
            lines.append(f"{row['provider']} {row['launch']}: wide scale loads, not a choice")
            continue
        if "+bits" in row["launch"]:
            lines.append(f"{row['provider']} {row['launch']}: scores by their bits, not a choice")
            continue
        label = _launch_label(launch)
        launches[label] = launch
        times = classes.setdefault((*table_key(block, head_dim), row["mode"]), {})
        at_block = times.setdefault(block, {})
        at_block[label] = min(float(row["ms"]), at_block.get(label, math.inf))
    choices, compared, picked = [], set(), set()
    for (dim_class, path, mode), by_block in sorted(classes.items()):
        blocks = sorted(by_block)
        names = list(dict.fromkeys(n for b in blocks for n in by_block[b]))
        chosen = _winner(names, [by_block[b] for b in blocks])
        title = f"head_dim {dim_class} {path} {mode}"
        if chosen is None or len(chosen[1]) < 2:
            lines.append(f"{title}: fewer than two launches measured at every block size; kept")
            continue
        winner, means = chosen
        compared.update(f"{mode} {name}" for name in means)
        picked.add(f"{mode} {winner}")
        for block in blocks:
            cells = ", ".join(f"{n} {ms:.3f}" for n, ms in by_block[block].items())
            lines.append(f"{title} | {block} | {cells} | winner {winner}")
        first = next(r for r in ran if r["mode"] == mode)
        choices.append(
            {
                "head_dim": dim_class,
                "kv_path": path,
                "mode": mode,
                **launches[winner],
                "source": "gpu run",
                "date": str(first["timestamp"])[:10],
                "device": str(first["device"]),
                "commit": str(first["commit"]),
                "evidence": f"launch_probe at blocks {', '.join(map(str, blocks))}, geometric "
                "mean of time over the fastest launch: "
                + ", ".join(f"{n} {mean:.3f}" for n, mean in means.items()),
            }
        )
    if compared:
        lines.append(not_picked("quantized launches", compared, picked))
    return choices, lines


def write_choices(path: Path, choices: Sequence[dict]) -> dict:
    """Replace the rows of ``choices``' classes in the launch table at ``path`` (others kept),
    checked before anything is written."""
    table = launch_table.read_table(path)
    new = {(c["head_dim"], c["kv_path"], c["mode"]): c for c in choices}
    kept = [r for r in table["choices"] if (r["head_dim"], r["kv_path"], r["mode"]) not in new]
    table["choices"] = sorted(
        [*kept, *new.values()], key=lambda r: (r["head_dim"], r["kv_path"], r["mode"])
    )
    launch_table.check_table(table)
    path.write_text(json.dumps(table, indent=1) + "\n")
    return table
