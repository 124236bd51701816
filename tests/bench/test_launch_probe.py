"""bench.launch_probe: configs parse, the forced launch reaches the kernel, rows are checked."""

from __future__ import annotations

import csv
import dataclasses
import importlib

import pytest
import torch

from paged_video.bench import launch_probe
from paged_video.bench.workload import Geometry

launcher = importlib.import_module("paged_video.kernels.paged_attention")
TINY = Geometry(16, 1, 1, 1, 2, 1, 32, "fp32", 1)
# The same shape under a 16-bit query, as the quantized modes' probes run.
TINY_FP16 = dataclasses.replace(TINY, dtype="fp16")


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
    tma = launch_probe.parse_launch("128x128w8s3+tma")
    assert tma == launch_probe.Launch(128, 128, 8, 3, variant="tma")
    assert str(tma) == "128x128w8s3+tma"
    both = launch_probe.parse_launch("default+wide+cp_async")
    assert both == launch_probe.Launch(wide_scales=True, variant="cp_async")
    assert str(both) == "default+wide+cp_async"
    bits = launch_probe.parse_launch("128x64w8s3+bits+cp_async")
    assert bits == launch_probe.Launch(128, 64, 8, 3, score_bits=True, variant="cp_async")
    assert str(bits) == "128x64w8s3+bits+cp_async"
    assert str(launch_probe.parse_launch("default+wide+bits")) == "default+wide+bits"
    with pytest.raises(ValueError, match=r"'default\+bits\+wide'"):
        launch_probe.parse_launch("default+bits+wide")  # one order, as str() writes it
    with pytest.raises(ValueError, match=r"'default\+ws'"):
        launch_probe.parse_launch("default+ws")  # the warp-specialized kernel is a sweep's
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


def test_score_bits_alone_keep_the_launchers_tile() -> None:
    kwargs = dict(block_size=64, head_dim=128, max_seqlen_q=64, dtype=torch.float32, k8v8=True)
    own = launcher.choose_tiles(**kwargs)
    with launch_probe.forced(launch_probe.parse_launch("default+bits")):
        tiles = launcher.choose_tiles(**kwargs)
    assert tiles == {**own, "SCORE_BITS": True} and own["SCORE_BITS"] is False


def test_runs_name_provider_and_config_pairs_in_order() -> None:
    runs = launch_probe.parse_runs("triton-int8@default+tma,triton@16x16w4s1")
    assert runs == [
        ("triton-int8", launch_probe.Launch(variant="tma")),
        ("triton", launch_probe.Launch(16, 16, 4, 1)),
    ]
    with pytest.raises(ValueError, match=r"PROVIDER@CONFIG.*'triton'"):
        launch_probe.parse_runs("triton")
    with pytest.raises(ValueError, match="no paged_attention provider 'tritn'"):
        launch_probe.parse_runs("tritn@default")


def test_a_forced_key_loop_reaches_the_launcher_or_says_why_not() -> None:
    kwargs = dict(block_size=64, head_dim=32, max_seqlen_q=64, dtype=torch.float32)
    with launch_probe.forced(launch_probe.parse_launch("16x32w4s2+tma")):
        tiles = launcher.choose_tiles(**kwargs)
    assert tiles["TMA"] and tiles["BLOCK_N"] == 32
    # A 128-key tile is two blocks of 64: a descriptor load per block (16-bit pools).
    with launch_probe.forced(launch_probe.parse_launch("16x128w4s2+tma")):
        tiles = launcher.choose_tiles(**kwargs)
    assert tiles["TMA"] and tiles["KV_PATH"] == "rows"
    # A 256-key tile is four: no descriptor load, so no run labelled +tma.
    straddling = launch_probe.parse_launch("16x256w4s2+tma")
    with launch_probe.forced(straddling), pytest.raises(ValueError, match=r"\+tma: no tile"):
        launcher.choose_tiles(**kwargs)
    # Pools no descriptor reads (slot-major quantized ones): the launcher would run pointers.
    tma = launch_probe.parse_launch("16x32w4s2+tma")
    with launch_probe.forced(tma), pytest.raises(ValueError, match="no descriptor reads"):
        launcher.choose_tiles(**kwargs, tma_ready=False)


def test_a_probe_records_the_loop_that_runs() -> None:
    # Over pools no descriptor reads, the launcher runs the pointer loop whatever the tiles say
    # (a table's TMA default): the row must say so.
    kwargs = dict(block_size=64, head_dim=32, max_seqlen_q=64, dtype=torch.float32, block_n=32)
    with launch_probe.forced(launch_probe.Launch()) as launched:
        tiles = launcher.choose_tiles(**kwargs, variant="tma", tma_ready=False)
        launcher.choose_tiles(**kwargs, variant="tma", tma_ready=True)
    assert tiles["TMA"] and tiles["VARIANT"] == "tma"
    assert [(r["variant"], r["tma"]) for r in launched] == [("cp_async", "off"), ("tma", "on")]


def test_a_probe_on_the_cpu_checks_every_run(tmp_path) -> None:
    launches = [launch_probe.Launch(), launch_probe.parse_launch("16x16w4s1+wide")]
    runs = launch_probe.every_pair(["triton", "triton-int8"], launches)
    rows = launch_probe.probe(runs, [8], tmp_path, geometry=TINY, device="cpu")
    assert [(r["provider"], r["launch"], r["outcome"]) for r in rows] == [
        ("triton", "default", "ok"),
        ("triton", "16x16w4s1+wide", "ok"),
        ("triton-int8", "default", "ok"),
        ("triton-int8", "16x16w4s1+wide", "ok"),
    ]
    assert all(r["max_error"] <= r["error_limit"] for r in rows)
    with open(tmp_path / "probe.csv", newline="") as stream:
        assert len(list(csv.DictReader(stream))) == 4


def _probe_all_run(runs: str, tmp_path) -> list[dict]:
    """``runs`` probed at block 64 on the tiny 16-bit geometry; every one of them must run."""
    rows = launch_probe.probe(
        launch_probe.parse_runs(runs), [64], tmp_path, geometry=TINY_FP16, device="cpu"
    )
    assert [r["outcome"] for r in rows] == ["ok"] * len(rows), rows
    return rows


def test_a_probe_row_names_its_mode_and_the_launch_that_ran(tmp_path) -> None:
    # bench choose turns these rows into quantized table rows: each must say which mode's row it
    # is (``_keys`` only where descriptors read the pools) and what ran, "default" included.
    rows = _probe_all_run(
        "triton-int8-keys@default,triton-int8-keys@16x32w4s2+tma,triton-int8@default",
        tmp_path,
    )
    assert len(rows) == 3, rows
    assert [r["mode"] for r in rows] == ["int8_keys", "int8_keys", "int8"]
    assert {(r["head_dim"], r["figures"]) for r in rows} == {(32, "cpu-interpreter")}
    own = launcher.choose_tiles(
        block_size=64, head_dim=32, max_seqlen_q=TINY_FP16.q_tokens, dtype=torch.float16,
        heads_per_kv_head=2, dequantize=True, tma_ready=True, kv_dtype=torch.int8,
    )  # fmt: skip
    assert f"tile={own['BLOCK_M']}x{own['BLOCK_N']} " in rows[0]["backend"], rows[0]["backend"]
    assert "variant=cp_async" in rows[0]["backend"]  # the interpreter's own default
    assert "variant=tma tile=16x32 warps=4 stages=2 tma=on" in rows[1]["backend"]
    with open(tmp_path / "probe.csv", newline="") as stream:
        written = list(csv.DictReader(stream))
    assert [r["backend"] for r in written] == [r["backend"] for r in rows]


def test_the_dequantizing_keys_major_runs_of_the_gpu_check(tmp_path) -> None:
    # bench/gpu_check.sh times them against their TMA loop: the rows must name the dequantizing
    # modes' _keys rows, and the TMA launch must run as asked (not fall back).
    rows = _probe_all_run("triton-int8-keys@default,triton-int8-keys@16x32w4s2+tma", tmp_path)
    assert len(rows) == 2, rows
    assert [r["mode"] for r in rows] == ["int8_keys", "int8_keys"]
    assert all("variant=tma tile=16x32" in r["backend"] for r in rows[1:]), rows
    assert all(r["max_error"] <= r["error_limit"] for r in rows)
