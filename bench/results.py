"""The long-format results CSV: one row per (kernel, provider, parameters), with provenance."""

from __future__ import annotations

import csv
import datetime
import math
import platform
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import torch
import triton

# The parameters that fix one forward's shape (everything but the block size and the tile).
GEOMETRY_COLUMNS = (
    "chunk_size",
    "frames",
    "sink_chunks",
    "window_chunks",
    "batch",
    "heads",
    "kv_heads",
    "head_dim",
    "dtype",
)
PARAMETER_COLUMNS = ("block_size", "tile", *GEOMETRY_COLUMNS, "q_tokens", "kv_tokens")
# Values of the "kernel" column (besides "ceiling"); the attention ones are rated in TFLOP/s.
KERNELS = ("paged_attention", "staged", "gather_blocks", "write_slots")
ATTENTION_KERNELS = ("paged_attention", "staged")
# What a provider is to the comparison: this project's kernel, a baseline it must beat, the
# fastest of several baselines repeated under one name (``sdpa-best``), a bound (a plain device
# copy of the same bytes, not a result) or the float64 oracle (correctness only).
# ``quantized``: this project's kernel over FP8/INT8 pools, rated against the bf16 pool (ours).
ROLES = ("ours", "baseline", "best-of", "bound", "oracle", "quantized")
# The quantized providers and their goal: the speedup over this project's paged attention on
# the bf16 pool at the same block size.
QUANTIZED_GOALS = {
    "triton-int8": 1.3,
    "triton-int8-keys": 1.3,
    # Issue 45: the fast format at least 1.5x the bf16 pool; the accurate one at least as fast.
    "triton-k8v8": 1.5,
    "triton-k8v16": 1.0,
}
# Provider names of CSVs written before the formats were spelled one way everywhere (bf16, e4m3,
# int8); reading an old CSV renames them, so ``compare`` matches its cases with new runs.
RENAMED_PROVIDERS = {"triton-fp8": "triton-e4m3", "triton-fp8-mma": "triton-e4m3-mma"}
MEASURE_COLUMNS = (
    "p50_ms",
    "p20_ms",
    "p80_ms",
    "min_ms",
    "tflops",
    "gbps",
    "tflops_vs_matmul",
    "gbps_vs_copy",
    "max_error",
    "torch_error",
    "error_limit",
)
# ``skipped``: why a provider did not run (its row has no measurements; ``read_rows`` leaves
# such rows out unless asked). ``phase``: "start" or "end" on the ceiling rows. ``noise``: the
# run's verdict, the same on every row ("steady", or "noisy: why"), filled in when the run ends
# (empty: cut short).
RUN_COLUMNS = ("phase", "noise")
PROVENANCE_COLUMNS = ("figures", "device", "torch", "triton", "commit", "timestamp")
COLUMNS = (
    "kernel",
    "provider",
    "backend",
    "role",
    *PARAMETER_COLUMNS,
    *MEASURE_COLUMNS,
    "skipped",
    *RUN_COLUMNS,
    *PROVENANCE_COLUMNS,
)
# Columns a CSV written before they existed may lack; reading fills them in.
LATER_COLUMNS = frozenset(
    {"backend", "role", "min_ms", "torch_error", "error_limit", "skipped", *RUN_COLUMNS}
)
INTEGER_COLUMNS = frozenset(PARAMETER_COLUMNS) - {"tile", "dtype"}

Row = dict[str, object]
GPU_FIGURES = "gpu"


def is_gpu_row(row: Row) -> bool:
    """Whether ``row`` timed a GPU kernel (its ``figures`` column); CPU rows are not a speed."""
    return row.get("figures") == GPU_FIGURES


def headline_ms(row: Row) -> float:
    """The time a row is judged by: its median on a GPU, its minimum on a CPU, where
    interference from other processes only ever adds time (rows without ``min_ms``, written
    before it existed, give their median)."""
    if not is_gpu_row(row) and row.get("min_ms") is not None:
        return float(row["min_ms"])
    return float(row["p50_ms"])


def sig3(value: object) -> str:
    """``value`` to three significant digits in fixed-point notation (``1230``, ``0.0123``)."""
    if value is None:
        return "-"
    number = float(value)
    if not math.isfinite(number):
        return str(number)
    if number == 0:
        return "0"
    rounded = float(f"{number:.3g}")
    decimals = max(0, 2 - math.floor(math.log10(abs(rounded))))
    return f"{rounded:.{decimals}f}"


def git_commit() -> str:
    """``git rev-parse HEAD`` of this checkout, or ``"unknown"``."""
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return result.stdout.strip() or "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.processor() or platform.machine()}".strip()


def provenance(device: torch.device, figures: str) -> Row:
    """The columns every row of one run shares."""
    return {
        "figures": figures,
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": git_commit(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


class CsvWriter:
    """Writes the header at once and flushes every row, so a killed run keeps what it measured."""

    def __init__(self, stream: IO[str], columns: tuple[str, ...] = COLUMNS) -> None:
        self._stream = stream
        self._columns = columns
        self._writer = csv.DictWriter(stream, fieldnames=columns, extrasaction="raise")
        self._writer.writeheader()
        stream.flush()

    def write(self, row: Row) -> None:
        self._writer.writerow({name: _format(row.get(name)) for name in self._columns})
        self._stream.flush()


def _format(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_rows(path: str | Path, rows: list[Row]) -> None:
    """Write a whole results CSV at once (replacing the file only when it is complete)."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", newline="") as stream:
        writer = CsvWriter(stream)
        for row in rows:
            writer.write(row)
    partial.replace(path)


def _default_role(provider: str) -> str:
    """The role of a row from a CSV written before the ``role`` column existed."""
    return {"triton": "ours", "reference": "oracle"}.get(provider, "baseline")


def read_rows(path: str | Path, *, skipped: bool = False) -> list[Row]:
    """Rows of a results CSV, numbers parsed (empty cells become None); the rows of providers
    that did not run (their ``skipped`` reason set) only when ``skipped``.

    Raises ``ValueError`` naming ``path``, in one line, when it is a folder, an accuracy CSV or
    not a results CSV.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not a results CSV (e.g. {path / 'sweep.csv'})")
    with open(path, newline="") as stream:
        reader = csv.DictReader(stream)
        present = set(reader.fieldnames or ())
        if {"cosine", "rel_l1", "meets_goal"} <= present:
            raise ValueError(
                f"{path} is an accuracy CSV (bench accuracy printed its table when it wrote it); "
                "table, plot and compare read the sweep's results CSV (sweep.csv)"
            )
        missing = [c for c in COLUMNS if c not in LATER_COLUMNS and c not in present]
        if missing:
            shown = ", ".join(missing[:4]) + (
                f" and {len(missing) - 4} more" if len(missing) > 4 else ""
            )
            raise ValueError(f"{path} is not a results CSV of bench sweep: missing columns {shown}")
        rows = []
        for line, raw in enumerate(reader, start=2):
            row = {name: None if name in MEASURE_COLUMNS else "" for name in LATER_COLUMNS}
            try:
                row.update(_parse(raw))
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"{path}, line {line}: not a number where one belongs ({error})"
                ) from None
            row["provider"] = RENAMED_PROVIDERS.get(str(row["provider"]), row["provider"])
            if not row["role"] and row["kernel"] != "ceiling":
                row["role"] = _default_role(str(row["provider"]))
            if skipped or not row["skipped"]:
                rows.append(row)
        return rows


def _parse(row: dict[str, str]) -> Iterator[tuple[str, object]]:
    for name, text in row.items():
        if not text and (name in INTEGER_COLUMNS or name in MEASURE_COLUMNS):
            yield name, None
        elif name in INTEGER_COLUMNS:
            yield name, int(text)
        elif name in MEASURE_COLUMNS:
            yield name, float(text)
        else:
            yield name, text


# Start and end ceilings further apart than this (relative to the lower) make a run noisy.
CEILING_DRIFT = 0.2
STEADY = "steady"


def noise_verdict(rows: list[Row]) -> str:
    """``"steady"``, ``"noisy: why"``, or ``""`` when the run has no end ceilings (cut short).

    Noisy when a ceiling measured at the start and at the end of the run disagree by more than
    ``CEILING_DRIFT``. On a GPU also when a measured row is faster than the higher of its two
    ceilings (the matmul of its dtype for attention, the copy for the copy kernels). A CPU run
    is never judged that way: its small, cache-resident copies and matmuls beat a 16 MiB copy
    or a 256-wide matmul without anything being wrong.
    """
    ceilings: dict[tuple[object, object], dict[str, float]] = {}
    for row in rows:
        if row["kernel"] == "ceiling":
            value = row["tflops"] if row["provider"] == "matmul" else row["gbps"]
            ceilings.setdefault((row["provider"], row["dtype"]), {})[str(row["phase"])] = value
    if not ceilings or any("end" not in phases for phases in ceilings.values()):
        return ""
    reasons = []
    for (name, dtype), phases in ceilings.items():
        start, end = phases.get("start"), phases["end"]
        if start and end and max(start, end) / min(start, end) - 1 > CEILING_DRIFT:
            what = f"{name} {dtype}".strip()
            reasons.append(f"{what} ceiling {sig3(start)} at start, {sig3(end)} at end")
    above = []
    for row in rows:
        skip = row["kernel"] == "ceiling" or row["role"] == "best-of" or row.get("skipped")
        if skip or not is_gpu_row(row):
            continue
        if row["kernel"] in ATTENTION_KERNELS:
            value, name, dtype = row["tflops"], "matmul", row["dtype"]
        else:
            value, name, dtype = row["gbps"], "copy", ""
        roof = max(ceilings.get((name, dtype), {}).values(), default=None)
        if value is not None and roof and value > roof:
            above.append(f"{row['kernel']}/{row['provider']} B={row['block_size']}")
    if above:
        shown = ", ".join(above[:3]) + (f" and {len(above) - 3} more" if len(above) > 3 else "")
        reasons.append(f"{len(above)} rows above their ceiling ({shown})")
    return f"noisy: {'; '.join(reasons)}" if reasons else STEADY


def is_noisy(rows: list[Row]) -> bool:
    """Whether the run that wrote ``rows`` was marked noisy (its ``noise`` column)."""
    return bool(rows) and str(rows[0].get("noise") or "").startswith("noisy")
