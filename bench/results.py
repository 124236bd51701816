"""The long-format results CSV: one row per (kernel, provider, parameters), with provenance."""

from __future__ import annotations

import csv
import datetime
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
MEASURE_COLUMNS = (
    "p50_ms",
    "p20_ms",
    "p80_ms",
    "tflops",
    "gbps",
    "tflops_vs_matmul",
    "gbps_vs_copy",
    "max_error",
)
PROVENANCE_COLUMNS = ("figures", "device", "torch", "triton", "commit", "timestamp")
COLUMNS = ("kernel", "provider", *PARAMETER_COLUMNS, *MEASURE_COLUMNS, *PROVENANCE_COLUMNS)
INTEGER_COLUMNS = frozenset(PARAMETER_COLUMNS) - {"tile", "dtype"}

Row = dict[str, object]


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

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._writer = csv.DictWriter(stream, fieldnames=COLUMNS, extrasaction="raise")
        self._writer.writeheader()
        stream.flush()

    def write(self, row: Row) -> None:
        self._writer.writerow({name: _format(row.get(name)) for name in COLUMNS})
        self._stream.flush()


def _format(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def read_rows(path: str | Path) -> list[Row]:
    """Rows of a results CSV, numbers parsed (empty cells become None)."""
    with open(path, newline="") as stream:
        reader = csv.DictReader(stream)
        missing = set(COLUMNS) - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path} is not a results CSV: missing columns {sorted(missing)}")
        return [dict(_parse(row)) for row in reader]


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
