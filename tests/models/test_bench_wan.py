"""``python -m paged_video.bench.wan_rollout --tiny`` runs (the GPU run of the 1.3B shape is the
same code)."""

from __future__ import annotations

import argparse
import csv

import pytest

pytest.importorskip("diffusers")

from paged_video.bench import wan_rollout


def test_tiny_rollout_bench_runs_and_both_rollouts_agree(capsys, tmp_path):
    argv = ["--tiny", "--blocks", "2", "--kv-dtype", "bf16", "int8", "--out", str(tmp_path)]
    assert wan_rollout.main(argv) == 0
    out = capsys.readouterr().out
    header, *rows = [line.split() for line in out.splitlines()[1:-2] if line]
    assert header[:4] == ["provider", "kv_dtype", "pool", "pool_MB"]
    table = {(row[0], row[1]): dict(zip(header[2:], row[2:], strict=True)) for row in rows}
    # --tiny is a float32 model: "bf16" keeps the pools in the model's dtype, and says so.
    assert "--kv-dtype bf16: unquantized pools in the model's fp32" in out.splitlines()[0]
    assert table.keys() == {("paged", "bf16"), ("paged", "int8"), ("plain", "-")}
    assert [table[k]["pool"] for k in sorted(table)] == ["fp32", "int8", "fp32"]
    for row in table.values():
        assert float(row["first_block_ms"]) > 0 and float(row["steady_block_ms"]) > 0
        # Frames per second once the window is full: frames per block over that block's time.
        assert float(row["steady_fps"]) == pytest.approx(1e3 / float(row["steady_block_ms"]), 0.01)
    paged, int8 = table["paged", "bf16"], table["paged", "int8"]
    # fp32 tiny model: the paged rollout and the plain-cache rollout give the same latents.
    assert float(paged["max_diff_vs_plain"]) < 1e-4
    # int8 pools: head_dim 32 codes + a float32 scale per (slot, head) against 32 float32s,
    # plus the K means; the latents move by the quantization, not more.
    assert float(int8["pool_MB"]) < 0.3 * float(paged["pool_MB"])
    assert 1e-4 < float(int8["max_diff_vs_plain"]) < 1e-2
    assert "Self-Forcing 17 FPS, LongLive 20.7 FPS" in out
    with open(tmp_path / "rollout.csv", newline="") as stream:
        written = list(csv.DictReader(stream))
    assert [(r["provider"], r["kv_dtype"], r["steady_fps"]) for r in written] == [
        (provider, kv, table[provider, kv]["steady_fps"]) for provider, kv in table
    ]


def test_the_deleted_mma_modes_are_no_formats() -> None:
    assert wan_rollout._kv_dtype("int8") == "int8"
    for deleted in ("int8-mma", "e4m3-mma", "int4"):
        with pytest.raises(argparse.ArgumentTypeError, match="not one of bf16, int8"):
            wan_rollout._kv_dtype(deleted)
    with pytest.raises(argparse.ArgumentTypeError, match=r"'e4m3' \(the e4m3 dequantizing pool"):
        wan_rollout._kv_dtype("e4m3")


def test_shipped_shape_is_wan_2_1_1_3b():
    shape = wan_rollout.WAN_1_3B
    assert (shape.layers, shape.heads, shape.head_dim, shape.ffn_dim) == (30, 12, 128, 8960)
    assert shape.tokens_per_frame == 1560 and shape.frames_per_block == 3
    assert (shape.sink_frames, shape.window_frames) == (9, 9)
