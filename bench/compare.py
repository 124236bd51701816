"""``python -m paged_video.bench compare OLD.csv NEW.csv``: what changed between two runs, case
by case.

A case is one (kernel, provider, tile, block size, geometry). For each case in both CSVs it
prints the medians and ``new / old``; it calls a change (``faster`` / ``slower``) only when the
two runs' p20-p80 ranges do not overlap, and ``same`` otherwise: timing noise is not a change.

It calls no change at all (``not called``) when either run was marked noisy or timed on a CPU:
a noisy run's ranges mean nothing, and CPU figures are not a speed (the interpreter's time
says nothing about a GPU kernel's).
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_video.bench.results import GEOMETRY_COLUMNS, Row, is_gpu_row, is_noisy
from paged_video.bench.table import aligned, noise_line, sig3

CASE_COLUMNS = ("kernel", "provider", "tile", "block_size", *GEOMETRY_COLUMNS)
NOT_CALLED = "not called"


def _cases(rows: Sequence[Row]) -> dict[tuple[object, ...], Row]:
    return {
        tuple(r[c] for c in CASE_COLUMNS): r
        for r in rows
        if r["kernel"] != "ceiling" and r.get("role") != "best-of"
    }


def verdict(old: Row, new: Row) -> str:
    """``faster``/``slower`` when the p20-p80 ranges are disjoint, else ``same``."""
    if new["p80_ms"] < old["p20_ms"]:
        return "faster"
    if new["p20_ms"] > old["p80_ms"]:
        return "slower"
    return "same"


def why_not_called(old_rows: Sequence[Row], new_rows: Sequence[Row]) -> str | None:
    """Why no change may be called between the two runs (CPU figures, a noisy run), or None."""
    reasons = []
    for name, rows in (("old", old_rows), ("new", new_rows)):
        if rows and not is_gpu_row(rows[0]):
            figures = rows[0].get("figures") or "cpu"
            reasons.append(f"the {name} run has {figures} figures, which are not a speed")
        elif is_noisy(list(rows)):
            reasons.append(f"the {name} run was marked noisy")
    return "no change called: " + " and ".join(reasons) if reasons else None


def compare_rows(old_rows: Sequence[Row], new_rows: Sequence[Row]) -> list[tuple[Row, Row, str]]:
    """``(old, new, verdict)`` for every case present in both, in the new run's order; the
    verdict is ``NOT_CALLED`` for every case when ``why_not_called`` has a reason."""
    old = _cases(old_rows)
    refused = why_not_called(old_rows, new_rows) is not None
    return [
        (old[key], row, NOT_CALLED if refused else verdict(old[key], row))
        for key, row in _cases(new_rows).items()
        if key in old
    ]


def format_compare(old_rows: Sequence[Row], new_rows: Sequence[Row]) -> str:
    """The comparison table, with each run's provenance and noise and a summary line."""
    pairs = compare_rows(old_rows, new_rows)
    lines = []
    for name, rows in (("old", old_rows), ("new", new_rows)):
        first = rows[0] if rows else {}
        lines.append(
            f"{name}: {first.get('figures', '?')} figures on {first.get('device', '?')}, "
            f"commit {str(first.get('commit', '?'))[:12]}, {first.get('timestamp', '?')}; "
            + (noise_line(rows) if rows else "no rows")
        )
    for column in ("figures", "device"):
        kinds = {str(r[column]) for r in (*old_rows[:1], *new_rows[:1])}
        if len(kinds) > 1:
            lines.append(f"warning: the runs differ in {column} ({' vs '.join(sorted(kinds))})")
    if not pairs:
        return "\n".join([*lines, "no case appears in both CSVs"])
    measured = [new for _, new, _ in pairs]
    varying = [c for c in GEOMETRY_COLUMNS if len({r[c] for r in measured}) > 1]
    header = ["kernel", "provider", "block", *varying, "old ms", "new ms", "new/old", "change"]
    body = []
    for old, new, call in pairs:
        provider = str(new["provider"]) + (
            f" {new['tile']}" if new["tile"] not in ("", "auto", None) else ""
        )
        body.append(
            [
                str(new["kernel"]),
                provider,
                str(new["block_size"]),
                *(str(new[c]) for c in varying),
                f"{sig3(old['p50_ms'])} ({sig3(old['p20_ms'])}-{sig3(old['p80_ms'])})",
                f"{sig3(new['p50_ms'])} ({sig3(new['p20_ms'])}-{sig3(new['p80_ms'])})",
                f"{sig3(new['p50_ms'] / old['p50_ms'])}x",
                call,
            ]
        )
    lines += aligned([header, *body])
    refused = why_not_called(old_rows, new_rows)
    if refused:
        lines.append(f"{len(pairs)} cases: {refused}")
        return "\n".join(lines)
    counts = {call: sum(1 for *_, c in pairs if c == call) for call in ("faster", "slower", "same")}
    summary = ", ".join(f"{n} {call}" for call, n in counts.items())
    lines.append(
        f"{len(pairs)} cases: {summary} (a change only where the p20-p80 ranges are apart)"
    )
    return "\n".join(lines)
