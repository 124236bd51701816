"""Plain-text tables of a sweep's rows (read back from the CSV or straight from the sweep).

Numbers print with three significant digits: times, throughputs and ratios in fixed-point
notation, errors in scientific notation.
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_video.bench.results import (
    ATTENTION_KERNELS,
    GEOMETRY_COLUMNS,
    QUANTIZED_GOALS,
    STEADY,
    Row,
    headline_ms,
    is_gpu_row,
    sig3,
)

# What a goal column says on a row timed on a CPU: such a figure is no speed to judge.
NOT_A_SPEED = "not a speed"


def sci3(value: object) -> str:
    """``value`` to three significant digits in scientific notation (``1.23e-04``)."""
    return "-" if value is None else f"{float(value):.2e}"


def _roof_percent(row: Row) -> str:
    if not is_gpu_row(row):  # cache-resident CPU data beat a memory-bound ceiling: no roof
        return "-"
    ratio = row["tflops_vs_matmul"] if row["kernel"] in ATTENTION_KERNELS else row["gbps_vs_copy"]
    return "-" if ratio is None else sig3(100 * ratio)


def geometry_label(row: Row) -> str:
    """``bf16 H40/40 D128 C1560 q4680 kv28080 b1``: dtype, heads/KV heads, head_dim, frame,
    queries and keys per sequence, batch."""
    return (
        f"{row['dtype']} H{row['heads']}/{row['kv_heads']} D{row['head_dim']} "
        f"C{row['chunk_size']} q{row['q_tokens']} kv{row['kv_tokens']} b{row['batch']}"
    )


def series_label(row: Row) -> str:
    """The provider, with the tile when one was forced (``triton 64x32``) and the backend that
    ``sdpa-best`` picked (``sdpa-best=sdpa-flash``)."""
    label = str(row["provider"])
    if row.get("role") == "best-of" and row.get("backend"):
        label += f"={row['backend']}"
    tile = row["tile"]
    return f"{label} {tile}" if tile not in ("", "auto", None) else label


def noise_line(rows: Sequence[Row]) -> str:
    """What the run's start and end ceilings say about its noise."""
    verdict = str(rows[0].get("noise") or "")
    if not verdict:
        return "noise: unknown (no end-of-run ceilings: the run was cut short or is older)"
    if verdict == STEADY and not is_gpu_row(rows[0]):
        return "noise: steady (ceilings within 20% start to end)"
    if verdict == STEADY:
        return "noise: steady (ceilings within 20% start to end, no row above its ceiling)"
    return f"NOISY RUN, figures unreliable: {verdict.removeprefix('noisy: ')}"


def _provenance_lines(rows: Sequence[Row]) -> list[str]:
    first = rows[0]
    lines = [
        f"{first['figures']} figures on {first['device']} (torch {first['torch']}, "
        f"triton {first['triton']}, commit {str(first['commit'])[:12]}, {first['timestamp']})"
    ]
    if not is_gpu_row(first):
        lines.append(
            "CPU timings: they show the harness runs, not GPU speed (ms: the minimum of the "
            "timed calls, one torch thread by default; no goal is judged on them)."
        )
    roofs: dict[str, list[str]] = {}
    for r in rows:
        if r["kernel"] == "ceiling":
            name = f"matmul {r['dtype']} TFLOP/s" if r["provider"] == "matmul" else "copy GB/s"
            value = sig3(r["tflops"] if r["provider"] == "matmul" else r["gbps"])
            roofs.setdefault(name, []).append(f"{value} ({r.get('phase') or 'start'})")
    if roofs:
        lines.append("ceilings: " + "; ".join(f"{n} {', '.join(v)}" for n, v in roofs.items()))
    lines.append(noise_line(rows))
    return lines


def aligned(table: list[list[str]]) -> list[str]:
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in table
    ]


def _measured(rows: Sequence[Row]) -> list[Row]:
    return [r for r in rows if r["kernel"] != "ceiling" and not r.get("skipped")]


def skip_lines(rows: Sequence[Row]) -> list[str]:
    """One line per (kernel, provider, reason) of the rows that did not run, with their block
    sizes."""
    reasons: dict[tuple[object, object, object], list[str]] = {}
    for r in rows:
        if r.get("skipped"):
            key = (r["kernel"], r["provider"], r["skipped"])
            reasons.setdefault(key, []).append(str(r["block_size"]))
    return [
        f"skipped {kernel}/{provider} (block sizes {', '.join(dict.fromkeys(blocks))}): {why}"
        for (kernel, provider, why), blocks in reasons.items()
    ]


def _varying(measured: Sequence[Row]) -> list[str]:
    return [c for c in GEOMETRY_COLUMNS if len({r[c] for r in measured}) > 1]


def format_table(rows: Sequence[Row]) -> str:
    """The provenance, the ceilings, the noise verdict, then one line per measured row.

    ``% roof`` is TFLOP/s over the matmul ceiling for the attention kernels and GB/s over the
    copy ceiling for the copy kernels. ``error`` is the max error against the oracle and
    ``limit`` what it was allowed. Geometry columns appear only where they vary.
    """
    if not rows:
        return "no rows"
    lines = _provenance_lines(rows)
    measured = _measured(rows)
    varying = _varying(measured)
    show_tile = any(r["tile"] not in ("", "auto", None) for r in measured)
    header = ["kernel", "provider", "block", *(["tile"] if show_tile else []), *varying]
    show_min = any(r.get("min_ms") is not None for r in measured)
    header += ["p50 ms", "p20-p80 ms", *(["min ms"] if show_min else [])]
    header += ["TFLOP/s", "GB/s", "% roof", "error", "limit"]
    body = [
        [
            str(r["kernel"]),
            series_label({**r, "tile": ""}),
            str(r["block_size"]),
            *([str(r["tile"] or "-")] if show_tile else []),
            *(str(r[c]) for c in varying),
            sig3(r["p50_ms"]),
            f"{sig3(r['p20_ms'])}-{sig3(r['p80_ms'])}",
            *([sig3(r.get("min_ms"))] if show_min else []),
            sig3(r["tflops"]),
            sig3(r["gbps"]),
            _roof_percent(r),
            sci3(r["max_error"]),
            sci3(r["error_limit"]),
        ]
        for r in measured
    ]
    return "\n".join(lines + aligned([header, *body]) + skip_lines(rows))


def format_pivot(rows: Sequence[Row]) -> str:
    """The short form: per kernel and geometry, block sizes down, providers across.

    Cells are TFLOP/s for the attention kernels and GB/s for the copy kernels, at the headline
    time (the median on a GPU, the minimum on a CPU).
    """
    if not rows:
        return "no rows"
    lines = _provenance_lines(rows)
    groups: dict[tuple[object, ...], list[Row]] = {}
    for row in _measured(rows):
        key = (row["kernel"], *(row[c] for c in GEOMETRY_COLUMNS))
        groups.setdefault(key, []).append(row)
    for (kernel, *_), group in groups.items():
        metric, unit = ("tflops", "TFLOP/s") if kernel in ATTENTION_KERNELS else ("gbps", "GB/s")
        lines += ["", f"{kernel}, {unit} ({geometry_label(group[0])})"]
        providers = list(dict.fromkeys(series_label({**r, "backend": ""}) for r in group))
        blocks = sorted({r["block_size"] for r in group})
        cells = {
            (r["block_size"], series_label({**r, "backend": ""})): sig3(r[metric]) for r in group
        }
        table = [["block", *providers]]
        table += [[str(b), *(cells.get((b, p), "-") for p in providers)] for b in blocks]
        lines += aligned(table)
    return "\n".join(lines)


def ratio_cases(rows: Sequence[Row]) -> list[dict[str, object]]:
    """Per (kernel, geometry, block size), kernel by kernel, block sizes in the order they ran:
    this project's fastest row, the fastest baseline (``sdpa-best`` repeats one and the oracle
    is none), ``speedup = baseline / ours`` and, for the copy kernels, the fraction of a device
    copy of the same bytes (``of_copy``: the bound's time over ours)."""
    cases: dict[tuple[object, ...], list[Row]] = {}
    for row in _measured(rows):
        key = (row["kernel"], *(row[c] for c in GEOMETRY_COLUMNS), row["block_size"])
        cases.setdefault(key, []).append(row)
    result = []
    for group in cases.values():
        by_role: dict[str, list[Row]] = {}
        for row in group:
            by_role.setdefault(str(row["role"]), []).append(row)
        fastest = {role: min(rs, key=headline_ms) for role, rs in by_role.items()}
        ours, baseline, bound = (fastest.get(role) for role in ("ours", "baseline", "bound"))
        if ours is None:
            continue
        result.append(
            {
                "row": ours,
                "baseline": baseline,
                "speedup": headline_ms(baseline) / headline_ms(ours) if baseline else None,
                "of_copy": headline_ms(bound) / headline_ms(ours) if bound else None,
            }
        )
    kernels = list(dict.fromkeys(c["row"]["kernel"] for c in result))
    return sorted(result, key=lambda c: kernels.index(c["row"]["kernel"]))


# The goals ``--goal`` marks: at least as fast as the fastest baseline; the copy kernels at
# least this fraction of a device copy of the same bytes.
GOAL = 1.0
COPY_GOAL = 0.85


def _missed(case: dict[str, object]) -> list[str]:
    """The goals a ratio-table case misses (none judged on a CPU row: ``NOT_A_SPEED``)."""
    if not is_gpu_row(case["row"]):
        return [NOT_A_SPEED]
    speedup, of_copy = case["speedup"], case["of_copy"]
    missed = [f"BELOW {GOAL:.1f}x"] if speedup is not None and speedup < GOAL else []
    if of_copy is not None and of_copy < COPY_GOAL:
        missed.append(f"BELOW {100 * COPY_GOAL:.0f}% of copy")
    return missed


def _case_key(row: Row) -> tuple[object, ...]:
    return (row["kernel"], *(row[c] for c in GEOMETRY_COLUMNS), row["block_size"])


def quantized_cases(rows: Sequence[Row]) -> list[dict[str, object]]:
    """Per quantized row (our kernel over FP8/INT8 pools), this project's fastest row of the
    same kernel, geometry and block size over the bf16 pool (``bf16``) and ``speedup = bf16 /
    quantized``, in the order the rows ran."""
    measured = _measured(rows)
    ours: dict[tuple[object, ...], Row] = {}
    for row in measured:
        best = ours.get(_case_key(row))
        if row["role"] == "ours" and (best is None or headline_ms(row) < headline_ms(best)):
            ours[_case_key(row)] = row
    cases = []
    for row in measured:
        if row["role"] == "quantized":
            bf16 = ours.get(_case_key(row))
            speedup = headline_ms(bf16) / headline_ms(row) if bf16 else None
            cases.append({"row": row, "bf16": bf16, "speedup": speedup})
    return cases


def _format_quantized(cases: Sequence[dict[str, object]], goal: bool) -> list[str]:
    """The quantized pools' table: their time, our unquantized pool's (in the run's dtype, named
    in the header), the speedup and its goal."""
    ran = {str(case["row"]["provider"]) for case in cases}
    goals = ", ".join(f"{name} {sig3(g)}x" for name, g in QUANTIZED_GOALS.items() if name in ran)
    dtypes = {str(c["row"]["dtype"]) for c in cases}
    pool = dtypes.pop() if len(dtypes) == 1 else "unquantized"
    lines = [
        "",
        f"quantized KV pools: speedup = our {pool}-pool time / the quantized pool's "
        f"(goals: {goals})",
    ]
    varying = _varying([c["row"] for c in cases])
    header = ["kernel", "block", *varying, "provider", "ms", f"{pool} ms", "speedup", "goal"]
    body = []
    missed = 0
    for case in cases:
        row, bf16, speedup = case["row"], case["bf16"], case["speedup"]
        target = QUANTIZED_GOALS.get(str(row["provider"]))
        below = speedup is not None and target is not None and speedup < target
        judged = is_gpu_row(row)
        missed += below and judged
        mark = (f"BELOW {sig3(target)}x" if below else "") if judged else NOT_A_SPEED
        body.append(
            [
                str(row["kernel"]),
                str(row["block_size"]),
                *(str(row[c]) for c in varying),
                series_label(row),
                sig3(headline_ms(row)),
                sig3(headline_ms(bf16)) if bf16 else "-",
                "-" if speedup is None else f"{sig3(speedup)}x",
                "-" if target is None else f"{sig3(target)}x",
                *([mark] if goal else []),
            ]
        )
    lines += aligned([header + ([""] if goal else []), *body])
    if goal and not any(is_gpu_row(c["row"]) for c in cases):
        lines.append(f"quantized goals: not judged ({_cpu_figures(cases[0]['row'])})")
    elif goal:
        rated = sum(1 for c in cases if c["speedup"] is not None and is_gpu_row(c["row"]))
        lines.append(f"quantized goals: {missed} of {rated} rows below")
    return lines


def _cpu_figures(row: Row) -> str:
    return f"{row.get('figures') or 'cpu'} figures are not a speed"


def format_ratios(rows: Sequence[Row], *, goal: bool = False) -> str:
    """The ratio table: per (kernel, block size), ours against the fastest baseline measured in
    the same run. ``goal`` marks the rows below ``GOAL`` (1.0x), or for the copy kernels below
    ``COPY_GOAL`` of a copy, and counts them."""
    if not rows:
        return "no rows"
    cases = ratio_cases(rows)
    lines = _provenance_lines(rows)
    time = "median" if is_gpu_row(rows[0]) else "minimum"
    lines.append(f"speedup = fastest baseline's {time} / ours (above 1.00x: ours is faster)")
    quantized = quantized_cases(rows)
    if not cases:
        return "\n".join([*lines, "no rows of this project's kernels"])
    varying = _varying([c["row"] for c in cases])
    show_copy = any(c["of_copy"] is not None for c in cases)
    header = ["kernel", "block", *varying, "ours ms", "baseline", "baseline ms", "speedup"]
    header += (["% of copy"] if show_copy else []) + (["goal"] if goal else [])
    body = []
    for case in cases:
        ours, baseline, speedup = case["row"], case["baseline"], case["speedup"]
        line = [str(ours["kernel"]), str(ours["block_size"]), *(str(ours[c]) for c in varying)]
        line += [
            sig3(headline_ms(ours)),
            series_label(baseline) if baseline else "-",
            sig3(headline_ms(baseline)) if baseline else "-",
            "-" if speedup is None else f"{sig3(speedup)}x",
        ]
        if show_copy:
            line.append("-" if case["of_copy"] is None else f"{sig3(100 * case['of_copy'])}%")
        if goal:
            line.append(", ".join(_missed(case)))
        body.append(line)
    lines += aligned([header, *body])
    lines += skip_lines(rows)
    judged = [c for c in cases if is_gpu_row(c["row"])]
    if goal and not judged:
        lines.append(f"goals: not judged ({_cpu_figures(cases[0]['row'])})")
    elif goal:
        cases = judged
        below = sum(1 for c in cases if c["speedup"] is not None and c["speedup"] < GOAL)
        rated = sum(1 for c in cases if c["speedup"] is not None)
        copies = [c for c in cases if c["of_copy"] is not None]
        short = sum(1 for c in copies if c["of_copy"] < COPY_GOAL)
        lines.append(
            f"goal {sig3(GOAL)}x: {below} of {rated} rows below"
            + (
                f"; {100 * COPY_GOAL:.0f}% of copy: {short} of {len(copies)} below"
                if copies
                else ""
            )
        )
    if quantized:
        lines += _format_quantized(quantized, goal)
    return "\n".join(lines)
