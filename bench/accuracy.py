"""``python -m paged_video.bench accuracy``: how far quantized KV pools move attention from
float64 attention.

One frame of queries attends over the sink + window of the shipped model (by default 9 + 9
frames of 1,560 tokens: 28,080 keys; head_dim 128). Every row writes K/V through the real
``write_slots`` (codes and per-(token, head) scales; K minus the smoothing mean when smoothing)
and attends with the real ``paged_attention`` (the Triton interpreter on a CPU). The result is
compared with float64 attention on the original K/V: q, K and V are rounded to bf16 first (the
model's dtype), then everything is float64. The bf16 pool is the baseline row.

Data kinds (``make_data``; all values rounded to bf16):

- ``random``: q, K, V standard normal.
- ``k-outliers``: the same, plus a per-channel offset on K, as real video-diffusion keys have:
  in each head ``OUTLIER_CHANNELS`` channels chosen at random get a constant offset of random
  sign and magnitude uniform in ``OUTLIER_OFFSET`` (the other channels get none), the same for
  every token.

K smoothing subtracts a per-(head, channel) mean before quantizing; softmax does not change (a
query's scores all shift by ``q . mean``). The mean is chosen as the cache chooses it: over the
video tokens of the first write, here the first frame of the sink, in float32, then frozen.

Goal: cosine similarity >= 0.9995 and relative L1 (``sum|o - r| / sum|r|``) <= 0.02.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from paged_video import kernels, reference
from paged_video.bench.results import PROVENANCE_COLUMNS, CsvWriter, provenance, sig3
from paged_video.bench.table import aligned
from paged_video.bench.timing import figures_kind

DATA_KINDS = ("random", "k-outliers")
# Quantized formats by their short name; "bf16" (the baseline pool) is always measured.
FORMATS: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "int8": torch.int8}
BASELINE = "bf16"
DEQUANT, FP8_MMA = "dequant", "fp8-mma"
# The k-outliers generator: channels per head with an offset, and the offsets' magnitude range.
OUTLIER_CHANNELS = 4
OUTLIER_OFFSET = (10.0, 20.0)
GOAL_COSINE = 0.9995
GOAL_REL_L1 = 0.02
# The shipped model: 40 heads of 128, frames of 1,560 tokens, sink 9 + window 9 frames.
SHIPPED_HEADS = 40
# Queries per float64 reference call (bounds its score matrix: rows x keys x 8 bytes).
REFERENCE_ROWS = 256

ACCURACY_COLUMNS = (
    "data",
    "format",
    "mode",
    "k_smooth",
    "cosine",
    "rel_l1",
    "max_abs_error",
    "meets_goal",
    "heads",
    "head_dim",
    "chunk_size",
    "sink_chunks",
    "window_chunks",
    "q_tokens",
    "q_rows",
    "kv_tokens",
    "block_size",
    "q_dtype",
    "seed",
    "seconds",
    *PROVENANCE_COLUMNS,
)


@dataclass(frozen=True)
class Variant:
    """One row: a pool format (``bf16`` or a ``FORMATS`` key), the attention mode, smoothing."""

    format: str
    mode: str = DEQUANT
    smooth: bool = False

    @property
    def label(self) -> str:
        if self.format == BASELINE:
            return f"{BASELINE} pool"
        return f"{self.format} {self.mode}{' smooth-K' if self.smooth else ''}"


def variants(formats: Sequence[str], smoothing: Sequence[bool]) -> list[Variant]:
    """The bf16 baseline, then per quantized format its modes (fp8-mma for e4m3 only), each
    with and without K smoothing as asked."""
    rows = [Variant(BASELINE)]
    for name in formats:
        modes = (DEQUANT, FP8_MMA) if FORMATS[name] == torch.float8_e4m3fn else (DEQUANT,)
        rows += [Variant(name, mode, smooth) for mode in modes for smooth in smoothing]
    return rows


@dataclass(frozen=True)
class AccuracyConfig:
    """What to measure. ``q_rows``: the first queries of the frame that are attended (None: the
    whole frame). ``q_dtype``: the queries' and the bf16 pool's dtype in the kernels (float32
    on a CPU, where bf16 is not run: it holds the same bf16-rounded values)."""

    heads: int = 1
    head_dim: int = 128
    chunk_size: int = 1560
    sink_chunks: int = 9
    window_chunks: int = 9
    q_rows: int | None = None
    block_size: int = 1560
    data: tuple[str, ...] = DATA_KINDS
    formats: tuple[str, ...] = tuple(FORMATS)
    smoothing: tuple[bool, ...] = (False, True)
    q_dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0

    @property
    def kv_tokens(self) -> int:
        return (self.sink_chunks + self.window_chunks) * self.chunk_size

    @property
    def rows(self) -> int:
        """Queries attended: ``q_rows`` or the whole frame."""
        return self.chunk_size if self.q_rows is None else min(self.q_rows, self.chunk_size)


@dataclass(frozen=True)
class Data:
    """bf16-rounded float32 ``q (rows, H, D)``, ``keys``/``values (kv_tokens, H, D)``."""

    q: Tensor
    keys: Tensor
    values: Tensor


def _bf16(x: Tensor) -> Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def make_data(kind: str, config: AccuracyConfig) -> Data:
    """The q/K/V of data ``kind`` (see the module docstring), from ``config.seed`` alone."""
    if kind not in DATA_KINDS:
        raise ValueError(f"kind must be one of {DATA_KINDS}, got {kind!r}")
    c = config
    generator = torch.Generator().manual_seed(c.seed)
    shape = (c.heads, c.head_dim)
    q = torch.randn(c.rows, *shape, generator=generator)
    keys = torch.randn(c.kv_tokens, *shape, generator=generator)
    values = torch.randn(c.kv_tokens, *shape, generator=generator)
    if kind == "k-outliers":
        low, high = OUTLIER_OFFSET
        offset = torch.zeros(shape)
        for head in range(c.heads):
            channels = torch.randperm(c.head_dim, generator=generator)[:OUTLIER_CHANNELS]
            magnitude = low + (high - low) * torch.rand(OUTLIER_CHANNELS, generator=generator)
            sign = torch.randint(0, 2, (OUTLIER_CHANNELS,), generator=generator) * 2 - 1
            offset[head, channels] = magnitude * sign
        keys = keys + offset
    device = torch.device(c.device)
    return Data(*(_bf16(x).to(device) for x in (q, keys, values)))


def reference_output(data: Data) -> Tensor:
    """Float64 attention of ``data`` (already bf16-rounded), in slices of ``REFERENCE_ROWS``."""
    q = data.q
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for start in range(0, q.shape[0], REFERENCE_ROWS):
        rows = slice(start, start + REFERENCE_ROWS)
        out[rows] = reference.dense_attention(q[rows], data.keys, data.values)
    return out


@dataclass(frozen=True)
class Metrics:
    cosine: float
    rel_l1: float
    max_abs_error: float

    @property
    def meets_goal(self) -> bool:
        """Cosine >= 0.9995 and relative L1 <= 0.02 (NaN meets nothing)."""
        return self.cosine >= GOAL_COSINE and self.rel_l1 <= GOAL_REL_L1


def metrics(output: Tensor, expected: Tensor) -> Metrics:
    """Cosine similarity of the flattened outputs, ``sum|o - r| / sum|r|`` and ``max|o - r|``,
    in float64."""
    o = output.to(torch.float64).flatten()
    r = expected.to(torch.float64).flatten()
    cosine = float(o @ r) / max(float(o.norm() * r.norm()), 1e-300)
    diff = (o - r).abs()
    rel_l1 = float(diff.sum()) / max(float(r.abs().sum()), 1e-300)
    return Metrics(cosine, rel_l1, float(diff.max()))


def smoothing_mean(keys: Tensor, chunk_size: int) -> Tensor:
    """``(H, D)`` float32 mean of the first frame's keys: the cache's first write."""
    return keys[:chunk_size].to(torch.float32).mean(dim=0)


def attend(variant: Variant, data: Data, config: AccuracyConfig) -> Tensor:
    """Write ``data``'s K/V into a pool of ``variant``'s format with ``kernels.write_slots``
    (frame by frame, as the cache writes), then attend with ``kernels.paged_attention``."""
    c = config
    device = data.q.device
    heads, dim = c.heads, c.head_dim
    block = c.block_size
    used = math.ceil(c.kv_tokens / block)
    num_blocks = used + 1  # block 0 stays unused, as the cache's null block
    quantized = variant.format != BASELINE
    pool_dtype = FORMATS[variant.format] if quantized else c.q_dtype
    k_cache = torch.zeros(num_blocks, block, heads, dim, dtype=pool_dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    scales: dict[str, Tensor] = {}
    if quantized:
        scale_shape = (num_blocks, block, heads)
        scales = {
            "k_scale": torch.zeros(scale_shape, dtype=torch.float32, device=device),
            "v_scale": torch.zeros(scale_shape, dtype=torch.float32, device=device),
        }
    order = torch.randperm(used, generator=torch.Generator().manual_seed(c.seed)) + 1
    block_table = order.to(device=device, dtype=torch.int32).view(1, used)
    positions = torch.arange(c.kv_tokens, device=device)
    slots = block_table[0].long()[positions // block] * block + positions % block

    flat = (-1, heads, dim)
    write_scales = {name: s.view(-1, heads) for name, s in scales.items()}
    if variant.smooth:
        write_scales["k_smooth"] = smoothing_mean(data.keys, c.chunk_size)
    key_dtype = c.q_dtype  # the model's K/V dtype (bf16 on a GPU; float32 holding it on a CPU)
    for start in range(0, c.kv_tokens, c.chunk_size):
        frame = slice(start, start + c.chunk_size)
        kernels.write_slots(
            data.keys[frame].to(key_dtype),
            data.values[frame].to(key_dtype),
            k_cache.view(flat),
            v_cache.view(flat),
            slots[frame].to(torch.int32),
            **write_scales,
        )
    extra: dict[str, object] = dict(scales)
    if variant.mode == FP8_MMA:
        extra["fp8_mma"] = True
    rows = data.q.shape[0]
    return kernels.paged_attention(
        data.q.to(c.q_dtype),
        k_cache,
        v_cache,
        block_table,
        torch.tensor([0, rows], dtype=torch.int32, device=device),
        torch.tensor([c.kv_tokens], dtype=torch.int32, device=device),
        max_seqlen_q=rows,
        **extra,
    )


Row = dict[str, object]


def run_accuracy(
    config: AccuracyConfig,
    csv_path: str | Path,
    *,
    attend_fn: Callable[[Variant, Data, AccuracyConfig], Tensor] = attend,
    log: Callable[[str], None] | None = None,
) -> list[Row]:
    """Measure every (data kind, variant) of ``config``; the rows are written to ``csv_path``
    as they are measured and returned. ``attend_fn`` computes a variant's output (tests plant
    wrong ones)."""
    device = torch.device(config.device)
    shared = provenance(device, figures_kind(device))
    csv_path = Path(csv_path)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    cases = variants(config.formats, config.smoothing)
    with open(csv_path, "w", newline="") as stream:
        writer = CsvWriter(stream, ACCURACY_COLUMNS)
        for kind in config.data:
            data = make_data(kind, config)
            expected = reference_output(data)
            for variant in cases:
                started = time.monotonic()
                measured = metrics(attend_fn(variant, data, config), expected)
                row = _row(kind, variant, measured, config, time.monotonic() - started, shared)
                writer.write(row)
                rows.append(row)
                if log is not None:
                    log(f"{kind} {variant.label}: {format_metrics(measured)}")
    return rows


def _row(
    kind: str,
    variant: Variant,
    measured: Metrics,
    config: AccuracyConfig,
    seconds: float,
    shared: Row,
) -> Row:
    c = config
    return {
        "data": kind,
        "format": variant.format,
        "mode": variant.mode if variant.format != BASELINE else "",
        "k_smooth": "on" if variant.smooth else "off",
        "cosine": measured.cosine,
        "rel_l1": measured.rel_l1,
        "max_abs_error": measured.max_abs_error,
        "meets_goal": "yes" if measured.meets_goal else "no",
        "heads": c.heads,
        "head_dim": c.head_dim,
        "chunk_size": c.chunk_size,
        "sink_chunks": c.sink_chunks,
        "window_chunks": c.window_chunks,
        "q_tokens": c.chunk_size,
        "q_rows": c.rows,
        "kv_tokens": c.kv_tokens,
        "block_size": c.block_size,
        "q_dtype": str(c.q_dtype).removeprefix("torch."),
        "seed": c.seed,
        "seconds": seconds,
        **shared,
    }


def format_metrics(m: Metrics) -> str:
    return f"cosine {m.cosine:.6f}, rel L1 {sig3(100 * m.rel_l1)}%, max abs {m.max_abs_error:.3g}"


def describe(config: AccuracyConfig) -> list[str]:
    """What was measured, in words: the geometry, the queries, the data, the smoothing mean."""
    c = config
    queries = (
        f"all {c.chunk_size} queries of one frame"
        if c.rows == c.chunk_size
        else f"the first {c.rows} of the frame's {c.chunk_size} queries (a subset)"
    )
    return [
        f"{c.heads} heads (the shipped model has {SHIPPED_HEADS}), head_dim {c.head_dim}; "
        f"{queries} over sink {c.sink_chunks} + window {c.window_chunks} frames of "
        f"{c.chunk_size} tokens = {c.kv_tokens} keys; block_size {c.block_size}; "
        f"q and bf16 pool in {str(c.q_dtype).removeprefix('torch.')} (values bf16-rounded)",
        "reference: float64 attention on the bf16-rounded q, K, V; "
        "k-outliers: K + offsets of +-U"
        f"{OUTLIER_OFFSET} on {OUTLIER_CHANNELS} random channels per head; smoothing mean: "
        "per (head, channel) over the first frame's keys (the cache's first write)",
        f"goal: cosine >= {GOAL_COSINE} and rel L1 <= {GOAL_REL_L1}",
    ]


def format_rows(rows: Sequence[Row], *, markdown: bool = False) -> str:
    """The accuracy table: one line per (data, format, mode, smoothing); ``markdown`` for the
    README."""
    header = ["data", "format", "mode", "K smooth", "cosine", "rel L1", "max abs err", "goal"]
    body = [
        [
            str(r["data"]),
            str(r["format"]),
            str(r["mode"] or "-"),
            str(r["k_smooth"]),
            f"{r['cosine']:.6f}",
            f"{sig3(100 * r['rel_l1'])}%",
            f"{r['max_abs_error']:.3g}",
            "meets" if r["meets_goal"] == "yes" else "MISSES",
        ]
        for r in rows
    ]
    if not markdown:
        return "\n".join(aligned([header, *body]))
    lines = [header, ["---"] * len(header), *body]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
