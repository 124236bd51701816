"""The launch table: which kernel variant and launch settings ``paged_attention`` takes on a GPU.

``kernels/launch_choices.json`` holds one row per (head_dim class, key path, K/V mode): the
variant (``cp_async`` or ``tma``), the key tile, warps and stages, and one provenance
record for the whole table (date, device, commit, and whether a GPU run or the compile report
chose it). ``python -m paged_video.bench choose SWEEP.csv --write kernels/launch_choices.json``
rewrites it from a GPU sweep (docs/benchmarks.md, "The launch table").
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

# The loop that loads K/V tiles: ``cp_async`` pointer loads pipelined by Triton (every path),
# ``tma`` tensor-descriptor loads of the whole tiles of the contiguous path (docs/kernels.md).
VARIANTS = ("cp_async", "tma")
KV_PATHS = ("contiguous", "two_blocks", "rows")
MODES = ("same", "fp8", "int8", "fp8_mma", "int8_mma")
HEAD_DIM_CLASSES = (64, 128, 256)
SOURCES = ("compile evidence", "gpu run")
TABLE_PATH = Path(__file__).with_name("launch_choices.json")
_ROW_KEYS = ("head_dim", "kv_path", "mode", "variant", "block_n", "num_warps", "num_stages")
_PROVENANCE_KEYS = ("date", "device", "commit", "source", "evidence")


def head_dim_class(head_dim: int) -> int:
    """The table's head_dim class: the smallest of 64, 128, 256 holding ``head_dim``."""
    return next(d for d in HEAD_DIM_CLASSES if head_dim <= d)


def check_table(table: object) -> dict:
    """A launch table's structure and values, or a one-line ``ValueError`` naming the field."""
    if not isinstance(table, dict) or set(table) != {"provenance", "choices"}:
        raise ValueError("launch table: expected an object with 'provenance' and 'choices'")
    provenance = table["provenance"]
    if not isinstance(provenance, dict) or set(provenance) != set(_PROVENANCE_KEYS):
        raise ValueError(f"launch table: provenance needs exactly {', '.join(_PROVENANCE_KEYS)}")
    if provenance["source"] not in SOURCES:
        raise ValueError(f"launch table: source must be one of {SOURCES}")
    seen = set()
    for n, row in enumerate(table["choices"]):
        if not isinstance(row, dict) or set(row) != set(_ROW_KEYS):
            raise ValueError(f"launch table: choice {n} needs exactly {', '.join(_ROW_KEYS)}")
        allowed = {
            "head_dim": HEAD_DIM_CLASSES,
            "kv_path": KV_PATHS,
            "mode": MODES,
            "variant": VARIANTS,
            "num_stages": (1, 2, 3, 4, 5),
            "num_warps": (4, 8),
            "block_n": (16, 32, 64, 128),
        }
        for name, values in allowed.items():
            if row[name] not in values:
                raise ValueError(f"launch table: choice {n} {name}={row[name]!r} not in {values}")
        key = (row["head_dim"], row["kv_path"], row["mode"])
        if key in seen:
            raise ValueError(f"launch table: choice {n} repeats {key}")
        seen.add(key)
    return table


def read_table(path: Path | str = TABLE_PATH) -> dict:
    """A launch table file, checked."""
    return check_table(json.loads(Path(path).read_text()))


@functools.cache
def _shipped() -> dict[tuple[int, str, str], dict]:
    table = read_table()
    return {(r["head_dim"], r["kv_path"], r["mode"]): r for r in table["choices"]}


def lookup(head_dim: int, kv_path: str, mode: str) -> dict | None:
    """The shipped table's choice for a call, or ``None`` where it has none."""
    return _shipped().get((head_dim_class(head_dim), kv_path, mode))
