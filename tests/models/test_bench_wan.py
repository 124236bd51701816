"""``python -m bench.wan_rollout --tiny`` runs (the GPU run of the 1.3B shape is the same code)."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

from bench import wan_rollout


def test_tiny_rollout_bench_runs_and_both_rollouts_agree(capsys):
    assert wan_rollout.main(["--tiny", "--blocks", "2"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line}
    assert {"paged", "plain"} <= lines.keys()
    assert all(float(value) > 0 for name in ("paged", "plain") for value in lines[name][1:3])
    # fp32 tiny model: the paged rollout and the plain-cache rollout give the same latents.
    assert float(out.rsplit(":", 1)[1]) < 1e-4


def test_shipped_shape_is_wan_2_1_1_3b():
    shape = wan_rollout.WAN_1_3B
    assert (shape.layers, shape.heads, shape.head_dim, shape.ffn_dim) == (30, 12, 128, 8960)
    assert shape.tokens_per_frame == 1560 and shape.frames_per_block == 3
    assert (shape.sink_frames, shape.window_frames) == (9, 9)
