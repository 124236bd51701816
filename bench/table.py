"""A plain-text table of a sweep's rows (read back from the CSV or straight from the sweep)."""

from __future__ import annotations

from collections.abc import Sequence

from bench.results import ATTENTION_KERNELS, GEOMETRY_COLUMNS, Row


def _number(value: object, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _roof_percent(row: Row) -> str:
    ratio = row["tflops_vs_matmul"] if row["kernel"] in ATTENTION_KERNELS else row["gbps_vs_copy"]
    return "-" if ratio is None else f"{100 * ratio:.1f}"


def geometry_label(row: Row) -> str:
    """``bf16 H40/40 D128 C1560 q4680 kv28080 b1``: dtype, heads/KV heads, head_dim, frame,
    queries and keys per sequence, batch."""
    return (
        f"{row['dtype']} H{row['heads']}/{row['kv_heads']} D{row['head_dim']} "
        f"C{row['chunk_size']} q{row['q_tokens']} kv{row['kv_tokens']} b{row['batch']}"
    )


def series_label(row: Row) -> str:
    """The provider, with the tile when one was forced (``triton 64x32``)."""
    tile = row["tile"]
    return f"{row['provider']} {tile}" if tile not in ("", "auto", None) else str(row["provider"])


def _provenance_lines(rows: Sequence[Row]) -> list[str]:
    first = rows[0]
    lines = [
        f"{first['figures']} figures on {first['device']} (torch {first['torch']}, "
        f"triton {first['triton']}, commit {str(first['commit'])[:12]}, {first['timestamp']})"
    ]
    if first["figures"] != "gpu":
        lines.append("CPU timings: they show the harness runs, not GPU speed.")
    roofs = [
        f"matmul {r['dtype']} {_number(r['tflops'])} TFLOP/s"
        if r["provider"] == "matmul"
        else f"copy {_number(r['gbps'])} GB/s"
        for r in rows
        if r["kernel"] == "ceiling"
    ]
    if roofs:
        lines.append("ceilings: " + ", ".join(roofs))
    return lines


def _aligned(table: list[list[str]]) -> list[str]:
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in table
    ]


def format_table(rows: Sequence[Row]) -> str:
    """The provenance, the ceilings, then one line per measured row.

    ``% roof`` is TFLOP/s over the matmul ceiling for the attention kernels and GB/s over the
    copy ceiling for the copy kernels. Geometry columns appear only where they vary.
    """
    if not rows:
        return "no rows"
    lines = _provenance_lines(rows)
    measured = [r for r in rows if r["kernel"] != "ceiling"]
    varying = [c for c in GEOMETRY_COLUMNS if len({r[c] for r in measured}) > 1]
    show_tile = any(r["tile"] not in ("", "auto", None) for r in measured)
    header = ["kernel", "provider", "block", *(["tile"] if show_tile else []), *varying]
    header += ["p50 ms", "p20-p80 ms", "TFLOP/s", "GB/s", "% roof"]
    body = [
        [
            str(r["kernel"]),
            str(r["provider"]),
            str(r["block_size"]),
            *([str(r["tile"] or "-")] if show_tile else []),
            *(str(r[c]) for c in varying),
            _number(r["p50_ms"]),
            f"{_number(r['p20_ms'], 3)}-{_number(r['p80_ms'], 3)}",
            _number(r["tflops"]),
            _number(r["gbps"]),
            _roof_percent(r),
        ]
        for r in measured
    ]
    return "\n".join(lines + _aligned([header, *body]))


def format_pivot(rows: Sequence[Row]) -> str:
    """The short form: per kernel and geometry, block sizes down, providers across.

    Cells are TFLOP/s for the attention kernels and GB/s for the copy kernels, at the median.
    """
    if not rows:
        return "no rows"
    lines = _provenance_lines(rows)
    groups: dict[tuple[object, ...], list[Row]] = {}
    for row in rows:
        if row["kernel"] != "ceiling":
            key = (row["kernel"], *(row[c] for c in GEOMETRY_COLUMNS))
            groups.setdefault(key, []).append(row)
    for (kernel, *_), group in groups.items():
        metric, unit = ("tflops", "TFLOP/s") if kernel in ATTENTION_KERNELS else ("gbps", "GB/s")
        lines += ["", f"{kernel}, {unit} ({geometry_label(group[0])})"]
        providers = list(dict.fromkeys(series_label(r) for r in group))
        blocks = sorted({r["block_size"] for r in group})
        cells = {(r["block_size"], series_label(r)): _number(r[metric]) for r in group}
        table = [["block", *providers]]
        table += [[str(b), *(cells.get((b, p), "-") for p in providers)] for b in blocks]
        lines += _aligned(table)
    return "\n".join(lines)
