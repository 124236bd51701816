"""``python -m paged_video.bench choose SWEEP.csv [--write TABLE]``: the launch table from a GPU
sweep.

A sweep that names the launch providers (``LAUNCH_PROVIDERS``: this project's kernel at one
variant and key tile each) times every launch at every block size. Per (head_dim class, key
path at the built-in tile) the winner is the launch with the smallest geometric mean, over the
block sizes measured for that class, of its time over the fastest launch's at the same block
size (a launch missing at one of them does not compete, and a class where every launch misses
one, as in a run cut short, keeps its row; ties go to the first in ``LAUNCH_PROVIDERS``), and
its row names the winner's own variant and key tile (a block where the launcher fell back to
the pointer loop does not decide the variant). The
winner table prints every block size: each launch's time, the winner, ``sdpa-best`` and the
winner's speedup over it, and the quantized providers' speedup over ``sdpa-best``. ``--write``
replaces the table's rows of the classes measured (source ``gpu run``, with the run's date,
device and commit) and keeps the others; quantized launches keep the launcher's built-in
settings, so their rows are printed, never written.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

from paged_video.bench.providers import LAUNCH_PROVIDERS, QUANTIZED_PROVIDERS, SDPA_BEST
from paged_video.bench.results import Row, headline_ms
from paged_video.kernels import launch_table
from paged_video.kernels.paged_attention import table_key

_BACKEND = re.compile(
    r"variant=(?P<variant>\w+) tile=\d+x(?P<block_n>\d+) warps=(?P<num_warps>\d+) "
    r"stages=(?P<num_stages>\d+)"
)


def launch_of(row: Row) -> dict[str, object]:
    """The launch a launch provider's row ran, read from its ``backend``."""
    match = _BACKEND.search(str(row.get("backend") or ""))
    if not match:
        raise ValueError(f"{row['provider']}: backend {row.get('backend')!r} names no launch")
    launch = {k: int(v) if v.isdigit() else v for k, v in match.groupdict().items()}
    return launch


def _requested_launch(name: str, rows: Sequence[Row]) -> dict[str, object]:
    """The launch provider ``name``'s own variant and key tile, with the warps and stages of a
    row that ran that variant (at some block sizes of a class the launcher falls back to the
    pointer loop, e.g. a 128-key TMA tile over 24-slot blocks: the table must still name the
    variant that won where it applies)."""
    requested = LAUNCH_PROVIDERS[name]
    launches = [launch_of(row) for row in rows]
    ran = [launch for launch in launches if launch["variant"] == requested["variant"]]
    return {**(ran or launches)[0], **requested}


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def choose(rows: Sequence[Row]) -> tuple[list[dict], list[str]]:
    """The winning launch per (head_dim class, key path) of a sweep's 16-bit attention rows, and
    the winner table's lines."""
    attention = [r for r in rows if r.get("kernel") == "paged_attention" and not r.get("skipped")]
    launches = [r for r in attention if r["provider"] in LAUNCH_PROVIDERS]
    if not launches:
        raise ValueError(f"no rows of the launch providers ({', '.join(LAUNCH_PROVIDERS)})")
    figures = {str(r.get("figures")) for r in launches}
    if figures != {"gpu"}:
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
    choices, lines = [], []
    header = ["hd", "path", "block", *LAUNCH_PROVIDERS, "winner", SDPA_BEST, "vs sdpa"]
    header += list(QUANTIZED_PROVIDERS)
    lines.append(" | ".join(header))
    for (dim_class, path, dtype), cases in sorted(classes.items()):
        ratios: dict[str, list[float]] = {name: [] for name in LAUNCH_PROVIDERS}
        for case in cases:
            measured = {n: headline_ms(r) for n, r in by_case[case].items() if n in ratios}
            fastest = min(measured.values())
            for name in ratios:
                if name in measured:
                    ratios[name].append(measured[name] / fastest)
        complete = {n: v for n, v in ratios.items() if len(v) == len(cases)}
        if not complete:  # a run cut short: this class keeps its row
            lines.append(f"head_dim {dim_class} {path}: no launch measured at every block size")
            continue
        winner = min(complete, key=lambda n: _geomean(complete[n]))
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
                + ", ".join(f"{n} {_geomean(v):.3f}" for n, v in complete.items()),
            }
        )
    if not choices:
        raise ValueError("no class has a launch measured at every one of its block sizes")
    return choices, lines


def _line(dim_class: int, path: str, case: tuple, rows: dict[str, Row], winner: str) -> str:
    def ms(name: str) -> str:
        return f"{headline_ms(rows[name]):.3f}" if name in rows else "-"

    best = rows.get(SDPA_BEST)
    speedup = (
        f"{headline_ms(best) / headline_ms(rows[winner]):.2f}x" if best and winner in rows else "-"
    )
    quantized = [
        f"{headline_ms(best) / headline_ms(rows[n]):.2f}x" if best and n in rows else "-"
        for n in QUANTIZED_PROVIDERS
    ]
    cells = [str(dim_class), path, str(case[-1]), *map(ms, LAUNCH_PROVIDERS), winner]
    return " | ".join([*cells, ms(SDPA_BEST), speedup, *quantized])


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
