"""``python -m paged_video.bench.wan_rollout --tiny`` runs (the GPU run of the 1.3B shape is the
same code)."""

from __future__ import annotations

import argparse
import csv

import pytest
import torch

pytest.importorskip("diffusers")

from paged_video.bench import wan_rollout


def test_tiny_rollout_bench_runs_and_both_rollouts_agree(capsys, tmp_path):
    formats = ["bf16", "int8", "k8v8", "k8v16"]
    argv = ["--tiny", "--blocks", "2", "--kv-format", *formats, "--out", str(tmp_path)]
    assert wan_rollout.main(argv) == 0
    out = capsys.readouterr().out
    header, *rows = [line.split() for line in out.splitlines()[1:-2] if line]
    assert header[:4] == ["provider", "kv_format", "pool", "pool_MB"]
    table = {(row[0], row[1]): dict(zip(header[2:], row[2:], strict=True)) for row in rows}
    # --tiny is a float32 model: "bf16" keeps the pools in the model's dtype, and says so.
    assert "--kv-format bf16: unquantized pools in the model's fp32" in out.splitlines()[0]
    assert table.keys() == {("paged", f) for f in formats} | {("plain", "-")}
    # The pool column names K's and V's dtypes where they differ (k8v16's V: the model's).
    pools = {kv: row["pool"] for (_, kv), row in table.items()}
    assert pools == {
        "bf16": "fp32",
        "int8": "int8",
        "k8v8": "int8/e4m3",
        "k8v16": "int8/fp32",
        "-": "fp32",
    }
    for row in table.values():
        assert float(row["first_block_ms"]) > 0 and float(row["steady_block_ms"]) > 0
        # Frames per second once the window is full: frames per block over that block's time.
        assert float(row["steady_fps"]) == pytest.approx(1e3 / float(row["steady_block_ms"]), 0.01)
    paged = table["paged", "bf16"]
    # fp32 tiny model: the paged rollout and the plain-cache rollout give the same latents.
    assert float(paged["max_diff_vs_plain"]) < 1e-4
    # Quantized pools: 8-bit codes + scales against float32s (k8v16's V stays float32, so
    # about 5/8 of them); the latents move by the quantization, not more (k8v8's e4m3 V most).
    share = {kv: float(table["paged", kv]["pool_MB"]) / float(paged["pool_MB"]) for kv in formats}
    assert share["int8"] < 0.3 and share["k8v8"] < 0.3 and 0.5 < share["k8v16"] < 0.7, share
    for kv, most in (("int8", 1e-2), ("k8v8", 3e-2), ("k8v16", 1e-2)):
        assert 1e-4 < float(table["paged", kv]["max_diff_vs_plain"]) < most, kv
    assert "Self-Forcing 17 FPS, LongLive 20.7 FPS" in out
    with open(tmp_path / "rollout.csv", newline="") as stream:
        written = list(csv.DictReader(stream))
    assert [(r["provider"], r["kv_format"], r["steady_fps"]) for r in written] == [
        (provider, kv, table[provider, kv]["steady_fps"]) for provider, kv in table
    ]


def test_every_kv_format_is_a_rollout_format_and_the_deleted_ones_are_refused() -> None:
    for name in ("bf16", "int8", "k8v8", "k8v16"):
        assert wan_rollout._kv_format(name) == name
    for deleted in ("int8-mma", "e4m3-mma", "int4"):
        with pytest.raises(argparse.ArgumentTypeError, match="not one of bf16, k8v8, k8v16, int8"):
            wan_rollout._kv_format(deleted)
    with pytest.raises(argparse.ArgumentTypeError, match=r"'e4m3' \(the e4m3 dequantizing pool"):
        wan_rollout._kv_format("e4m3")


def test_the_flag_s_older_name_still_reads(monkeypatch) -> None:
    seen = {}
    monkeypatch.setattr(wan_rollout, "run", lambda *a, **kw: seen.update(kw) or {})
    wan_rollout.main(["--tiny", "--kv-dtype", "k8v8", "bf16", "k8v8"])
    assert seen["kv_formats"] == ("k8v8", "bf16")


def test_a_run_cut_short_keeps_the_rows_it_finished(monkeypatch, tmp_path) -> None:
    # A GPU window's stage limit may stop the run: each rollout's row is written as it ends.
    def plain_then_cut(*args, on_result, **kwargs):
        on_result("plain", {"times": [0.5, 0.25], "pool": (torch.float32,) * 2, "max_diff": 0.0})
        raise KeyboardInterrupt  # as the stage's timeout stops it

    monkeypatch.setattr(wan_rollout, "run", plain_then_cut)
    with pytest.raises(KeyboardInterrupt):
        wan_rollout.main(["--tiny", "--kv-format", "k8v8", "--out", str(tmp_path)])
    with open(tmp_path / "rollout.csv", newline="") as stream:
        written = list(csv.DictReader(stream))
    assert [(r["provider"], r["kv_format"], r["pool"]) for r in written] == [("plain", "-", "fp32")]


def test_shipped_shape_is_wan_2_1_1_3b():
    shape = wan_rollout.WAN_1_3B
    assert (shape.layers, shape.heads, shape.head_dim, shape.ffn_dim) == (30, 12, 128, 8960)
    assert shape.tokens_per_frame == 1560 and shape.frames_per_block == 3
    assert (shape.sink_frames, shape.window_frames) == (9, 9)
