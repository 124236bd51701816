"""The launch table: which kernel variant and launch settings ``paged_attention`` takes on a GPU.

``kernels/launch_choices.json`` holds one row per (head_dim class, key path, K/V mode): the
variant (``cp_async``, ``tma``, ``ws``), the key tile, warps and stages, and where the choice comes
from (``source``: a GPU run or the compile report; date, device, commit, evidence).
``python -m paged_video.bench choose SWEEP.csv --write kernels/launch_choices.json`` rewrites
it from a GPU sweep (docs/benchmarks.md, "The launch table").
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

# The loop that loads K/V tiles: ``cp_async`` pointer loads pipelined by Triton (every path),
# ``tma`` tensor-descriptor loads of the whole tiles of the contiguous path, ``ws`` those tiles
# in a warp-specialized kernel (a producer warp, 4-warp consumers) merged with the masked
# kernel's partial tiles (docs/kernels.md).
VARIANTS = ("cp_async", "tma", "ws")
KV_PATHS = ("contiguous", "block_tiles", "two_blocks", "rows")
MODES = ("same", "fp8", "int8", "fp8_mma", "int8_mma")
HEAD_DIM_CLASSES = (64, 128, 256)
SOURCES = ("compile evidence", "gpu run")
TABLE_PATH = Path(__file__).with_name("launch_choices.json")
_CHOICE_KEYS = ("head_dim", "kv_path", "mode", "variant", "block_n", "num_warps", "num_stages")
# Each row says where it comes from: a GPU run (its device) or the compile report.
_PROVENANCE_KEYS = ("source", "date", "device", "commit", "evidence")
ROW_KEYS = (*_CHOICE_KEYS, *_PROVENANCE_KEYS)
_ALLOWED = {
    "head_dim": HEAD_DIM_CLASSES,
    "kv_path": KV_PATHS,
    "mode": MODES,
    "variant": VARIANTS,
    "block_n": (16, 32, 64, 128),
    "num_warps": (4, 8),
    "num_stages": (1, 2, 3, 4, 5),
    "source": SOURCES,
}


def head_dim_class(head_dim: int) -> int:
    """The table's head_dim class: the smallest of 64, 128, 256 holding ``head_dim``."""
    return next(d for d in HEAD_DIM_CLASSES if head_dim <= d)


def check_table(table: object) -> dict:
    """A launch table's structure and values, or a one-line ``ValueError`` naming the field."""
    if not isinstance(table, dict) or set(table) != {"about", "choices"}:
        raise ValueError("launch table: expected an object with 'about' and 'choices'")
    seen = set()
    for n, row in enumerate(table["choices"]):
        if not isinstance(row, dict) or set(row) != set(ROW_KEYS):
            raise ValueError(f"launch table: choice {n} needs exactly {', '.join(ROW_KEYS)}")
        for name, values in _ALLOWED.items():
            if row[name] not in values:
                raise ValueError(f"launch table: choice {n} {name}={row[name]!r} not in {values}")
        for name in ("date", "device", "commit", "evidence"):
            if not isinstance(row[name], str) or not row[name]:
                raise ValueError(f"launch table: choice {n} {name} must be a non-empty string")
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
