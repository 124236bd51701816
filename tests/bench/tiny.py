"""The tiny sweep geometry and one-repetition timing the bench tests run on a CPU."""

from __future__ import annotations

from paged_video.bench.sweep import SweepConfig
from paged_video.bench.timing import TimingSettings
from paged_video.bench.workload import Geometry

TINY = Geometry(
    chunk_size=8,
    frames=1,
    sink_chunks=1,
    window_chunks=2,
    heads=2,
    kv_heads=1,
    head_dim=16,
    dtype="fp32",
)
QUICK = TimingSettings(cpu_reps=1)


def paged_config(**overrides: object) -> SweepConfig:
    """A sweep of our paged attention alone over ``TINY`` at block size 8, with overrides."""
    settings = dict(
        geometries=(TINY,), block_sizes=(8,), kernels=("paged_attention",), timing=QUICK
    )
    settings.update(overrides)
    return SweepConfig(**settings)
