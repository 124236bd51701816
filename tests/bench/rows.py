"""Hand-made result rows for the table, compare and noise tests (no timing involved)."""

from __future__ import annotations

from paged_video.bench.results import COLUMNS, MEASURE_COLUMNS, Row

GEOMETRY = dict(
    chunk_size=1560,
    frames=3,
    sink_chunks=9,
    window_chunks=9,
    batch=1,
    heads=40,
    kv_heads=40,
    head_dim=128,
    dtype="bf16",
    q_tokens=4680,
    kv_tokens=28080,
)
PROVENANCE = dict(
    figures="gpu",
    device="NVIDIA H200",
    torch="2.11.0",
    triton="3.6.0",
    commit="0123456789abcdef",
    timestamp="2026-12-03T10:00:00+00:00",
)


def measured(
    kernel: str,
    provider: str,
    block_size: int,
    p50: float,
    *,
    role: str = "baseline",
    spread: float = 0.01,
    **overrides: object,
) -> Row:
    """A measured row: median ``p50`` ms, p20/p80 ``spread`` (relative) either side."""
    row: Row = {name: None if name in MEASURE_COLUMNS else "" for name in COLUMNS}
    row.update(GEOMETRY)
    row.update(PROVENANCE)
    row.update(
        kernel=kernel,
        provider=provider,
        backend=provider,
        role=role,
        block_size=block_size,
        tile="auto" if role == "ours" else "",
        p50_ms=p50,
        p20_ms=p50 * (1 - spread),
        p80_ms=p50 * (1 + spread),
        noise="steady",
    )
    if kernel in ("paged_attention", "staged"):
        row["tflops"] = 100.0 / p50
    else:
        row["gbps"] = 1.0 / p50
    row.update(overrides)
    return row


def ceiling(name: str, phase: str, value: float, dtype: str = "bf16") -> Row:
    """A ceiling row: matmul TFLOP/s of ``dtype`` or copy GB/s."""
    row: Row = {column: None if column in MEASURE_COLUMNS else "" for column in COLUMNS}
    row.update(PROVENANCE)
    row.update(kernel="ceiling", provider=name, phase=phase, noise="steady")
    row.update(p50_ms=1.0, p20_ms=1.0, p80_ms=1.0)
    if name == "matmul":
        row.update(dtype=dtype, tflops=value)
    else:
        row.update(gbps=value)
    return row


STEADY_CEILINGS = [
    ceiling("matmul", "start", 700.0),
    ceiling("copy", "start", 4000.0),
    ceiling("matmul", "end", 690.0),
    ceiling("copy", "end", 3950.0),
]
