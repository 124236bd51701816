"""``python -m paged_video.bench.wan_rollout --tiny`` runs (the GPU run of the 1.3B shape is the
same code)."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

from paged_video.bench import wan_rollout


def test_tiny_rollout_bench_runs_and_both_rollouts_agree(capsys):
    assert wan_rollout.main(["--tiny", "--blocks", "2", "--kv-dtype", "bf16", "int8"]) == 0
    out = capsys.readouterr().out
    header, *rows = [line.split() for line in out.splitlines()[1:] if line]
    assert header[:3] == ["provider", "kv_dtype", "pool_MB"]
    table = {(row[0], row[1]): dict(zip(header[2:], row[2:], strict=True)) for row in rows}
    # --tiny is a float32 model: "bf16" keeps the pools in the model's dtype, and says so.
    assert "--kv-dtype bf16: unquantized pools in the model's fp32" in out.splitlines()[0]
    assert table.keys() == {("paged", "fp32"), ("paged", "int8"), ("plain", "fp32")}
    for row in table.values():
        assert float(row["first_block_ms"]) > 0 and float(row["steady_block_ms"]) > 0
    paged, int8 = table["paged", "fp32"], table["paged", "int8"]
    # fp32 tiny model: the paged rollout and the plain-cache rollout give the same latents.
    assert float(paged["max_diff_vs_plain"]) < 1e-4
    # int8 pools: head_dim 32 codes + a float32 scale per (slot, head) against 32 float32s,
    # plus the K means; the latents move by the quantization, not more.
    assert float(int8["pool_MB"]) < 0.3 * float(paged["pool_MB"])
    assert 1e-4 < float(int8["max_diff_vs_plain"]) < 1e-2


def test_shipped_shape_is_wan_2_1_1_3b():
    shape = wan_rollout.WAN_1_3B
    assert (shape.layers, shape.heads, shape.head_dim, shape.ffn_dim) == (30, 12, 128, 8960)
    assert shape.tokens_per_frame == 1560 and shape.frames_per_block == 3
    assert (shape.sink_frames, shape.window_frames) == (9, 9)
