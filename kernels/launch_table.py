"""The launch table: which kernel variant and launch settings ``paged_attention`` takes on a GPU.

``kernels/launch_choices.json`` holds one row per (head_dim class, key path, K/V mode): the
variant (``cp_async``, ``tma``, ``ws``), the key tile, whether the unmasked 16-bit loop
computes each tile's scores ahead (``scores_ahead``), warps and stages, and where the choice comes
from (``source``: a GPU run or the compile report; date, device, commit, evidence).
``python -m paged_video.bench choose SWEEP.csv --probe PROBE.csv --write
kernels/launch_choices.json`` rewrites it from a GPU run (docs/benchmarks.md, "The launch
table"): the 16-bit rows from a sweep of the launch providers, the quantized rows from
``bench.launch_probe``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

# The loop that loads K/V tiles: ``cp_async`` pointer loads pipelined by Triton (every path),
# ``tma`` tensor-descriptor loads of the whole tiles of the contiguous path, ``ws`` those tiles
# in a warp-specialized kernel (a producer warp, 4-warp consumers) merged with the masked
# kernel's partial tiles (docs/kernels.md).
VARIANTS = ("cp_async", "tma", "ws")
# A row's class is the key path at its head_dim class's built-in 64-key tile, where every block
# takes one of these (``two_blocks`` needs tiles of 256 keys: kernels.paged_attention.MAX_PIECES).
KV_PATHS = ("contiguous", "block_tiles", "rows")
# K/V modes: ``same`` (the query dtype), then the quantized ones (``kv_mode``): int8 codes
# dequantized, or the one-switch formats (the e4m3 pool's ``fp8`` was deleted, issue 45);
# ``_keys`` when the pools are ones the TMA loop reads (keys-major scales, and k8v8's V:
# ``kernels.keys_major``). Their loops differ (over keys-major pools k8v8's V needs no
# transpose), and only those take ``tma``.
QUANTIZED_MODES = ("int8", "k8v8", "k8v16")
MODES = ("same", *QUANTIZED_MODES, *(f"{mode}_keys" for mode in QUANTIZED_MODES))
# The fewest keys per tile of k8v8 (the K dimension of its FP8 P V MMA): Hopper's FP8 wgmma
# reduces over 32 at least.
FP8_MIN_KEYS = 32
HEAD_DIM_CLASSES = (64, 128, 256)
SOURCES = ("compile evidence", "gpu run")
TABLE_PATH = Path(__file__).with_name("launch_choices.json")
_CHOICE_KEYS = (
    "head_dim",
    "kv_path",
    "mode",
    "variant",
    "block_n",
    "scores_ahead",
    "num_warps",
    "num_stages",
)
# Each row says where it comes from: a GPU run (its device) or the compile report.
_PROVENANCE_KEYS = ("source", "date", "device", "commit", "evidence")
ROW_KEYS = (*_CHOICE_KEYS, *_PROVENANCE_KEYS)
_ALLOWED = {
    "head_dim": HEAD_DIM_CLASSES,
    "kv_path": KV_PATHS,
    "mode": MODES,
    "variant": VARIANTS,
    "block_n": (16, 32, 64, 128),
    "scores_ahead": (False, True),
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
            # (A bool is no value of the integer fields, nor 0 or 1 one of scores_ahead.)
            if row[name] not in values or isinstance(row[name], bool) != (name == "scores_ahead"):
                raise ValueError(f"launch table: choice {n} {name}={row[name]!r} not in {values}")
        for name in ("date", "device", "commit", "evidence"):
            if not isinstance(row[name], str) or not row[name]:
                raise ValueError(f"launch table: choice {n} {name} must be a non-empty string")
        _check_quantized(n, row)
        key = (row["head_dim"], row["kv_path"], row["mode"])
        if key in seen:
            raise ValueError(f"launch table: choice {n} repeats {key}")
        seen.add(key)
    return table


def _check_quantized(n: int, row: dict) -> None:
    """A row names a launch the launcher can make for its mode (a quantized one, or one of the
    warp-specialized kernel, computes no scores ahead)."""
    mode, variant = row["mode"], row["variant"]
    if row["scores_ahead"] and (mode != "same" or variant == "ws"):
        raise ValueError(
            f"launch table: choice {n} scores_ahead is a 16-bit 'cp_async' or 'tma' loop's"
        )
    if mode == "same":
        return
    if variant == "ws":
        raise ValueError(f"launch table: choice {n} variant 'ws' loads unquantized caches only")
    if variant == "tma" and not mode.endswith("_keys"):
        raise ValueError(
            f"launch table: choice {n} variant 'tma' needs a '_keys' mode (no descriptor reads "
            f"{mode!r} pools)"
        )
    if mode.startswith("k8v8") and row["block_n"] < FP8_MIN_KEYS:
        raise ValueError(
            f"launch table: choice {n} block_n={row['block_n']} < {FP8_MIN_KEYS} ({mode})"
        )


def kv_mode(
    kv_dtype: torch.dtype | None,
    *,
    keys_major: bool,
    k8v8: bool = False,
    k8v16: bool = False,
) -> str:
    """The table's K/V mode of a call: ``same`` for caches in the query dtype (``kv_dtype``
    None), else the quantized mode, with ``_keys`` where the TMA loop reads the pools."""
    if kv_dtype is None and not (k8v8 or k8v16):
        return "same"
    # Else int8 codes (the e4m3 pool, the table's fp8 modes, was deleted: issue 45).
    mode = ("k8v8" if k8v8 else "k8v16") if k8v8 or k8v16 else "int8"
    return f"{mode}_keys" if keys_major else mode


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
