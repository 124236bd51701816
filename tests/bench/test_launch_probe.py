"""bench.launch_probe: configs parse, the forced launch reaches the kernel, rows are checked."""

from __future__ import annotations

import csv
import importlib

import pytest
import torch

from paged_video.bench import launch_probe
from paged_video.bench.workload import Geometry

launcher = importlib.import_module("paged_video.kernels.paged_attention")
TINY = Geometry(16, 1, 1, 1, 2, 1, 32, "fp32", 1)


def test_configs_parse_and_bad_ones_are_named() -> None:
    assert launch_probe.parse_launch("128x64w8s3") == launch_probe.Launch(128, 64, 8, 3)
    assert str(launch_probe.parse_launch("default")) == "default"
    wide = launch_probe.parse_launch("128x64w8s2+wide")
    assert wide == launch_probe.Launch(128, 64, 8, 2, wide_scales=True)
    assert str(wide) == "128x64w8s2+wide"
    assert launch_probe.parse_launch("default+wide") == launch_probe.Launch(wide_scales=True)
    with pytest.raises(ValueError, match="'default\\+wid'"):
        launch_probe.parse_launch("default+wid")
    with pytest.raises(ValueError, match="'128x64w8'"):
        launch_probe.parse_launch("128x64w8")
    shipped = launch_probe.shipped_geometry()  # the sweep's --preset shipped
    assert (shipped.q_tokens, shipped.kv_tokens, shipped.heads) == (4680, 28080, 40)


def test_the_forced_launch_is_what_the_launcher_uses_and_is_undone() -> None:
    original = launcher.choose_tiles
    launch = launch_probe.parse_launch("32x16w2s5")
    with launch_probe.forced(launch):
        tiles = launcher.choose_tiles(
            block_size=8, head_dim=32, max_seqlen_q=64, dtype=torch.float32
        )
    assert (tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["num_warps"], tiles["num_stages"]) == (
        32, 16, 2, 5,
    )  # fmt: skip
    assert launcher.choose_tiles is original and tiles["WIDE_SCALES"] is False


def test_wide_scales_alone_keep_the_launchers_tile() -> None:
    kwargs = dict(block_size=8, head_dim=32, max_seqlen_q=64, dtype=torch.float32)
    own = launcher.choose_tiles(**kwargs)
    with launch_probe.forced(launch_probe.parse_launch("default+wide")):
        tiles = launcher.choose_tiles(**kwargs)
    assert tiles == {**own, "WIDE_SCALES": True} and own["WIDE_SCALES"] is False


def test_a_probe_on_the_cpu_checks_every_run(tmp_path) -> None:
    launches = [launch_probe.Launch(), launch_probe.parse_launch("16x16w4s1+wide")]
    rows = launch_probe.probe(
        ["triton", "triton-int8"], [8], launches, tmp_path, geometry=TINY, device="cpu"
    )
    assert [(r["provider"], r["launch"], r["outcome"]) for r in rows] == [
        ("triton", "default", "ok"),
        ("triton", "16x16w4s1+wide", "ok"),
        ("triton-int8", "default", "ok"),
        ("triton-int8", "16x16w4s1+wide", "ok"),
    ]
    assert all(r["max_error"] <= r["error_limit"] for r in rows)
    with open(tmp_path / "probe.csv", newline="") as stream:
        assert len(list(csv.DictReader(stream))) == 4
