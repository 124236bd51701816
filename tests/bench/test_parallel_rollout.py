"""``python -m paged_video.bench.parallel_rollout``: the communication bench runs on CPU ranks
and measures what the collectives really move; the timing half runs as a world of one."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

from paged_video.bench import parallel_rollout


def test_comm_bench_measures_traffic_flat_in_the_window(tmp_path, capsys):
    assert (
        parallel_rollout.main(
            ["comm", "--ranks", "2", "--windows", "1", "3", "--out", str(tmp_path)]
        )
        == 0
    )
    assert (tmp_path / "comm.png").stat().st_size > 0
    rows = parallel_rollout.read_csv(tmp_path / "comm.csv")
    assert [(r["layout"], r["window_frames"]) for r in rows] == [
        ("ulysses", 1),
        ("ulysses", 3),
        ("window shards", 1),
        ("window shards", 3),
    ]
    shape = parallel_rollout.COMM_SHAPE
    # Per layer and forward, both CFG rows of one 24-token frame, float32, 4 heads of 16.
    chunk = 2 * shape.tokens_per_frame * shape.heads * shape.head_dim * 4
    for window in (0, 1):
        ulysses, shards = rows[window], rows[2 + window]
        # Ulysses: q, k, v to the other rank and the output back, for half the tokens' other
        # half of the heads: (3 + 1) / 4 of the chunk per layer.
        assert ulysses["ulysses"] == shape.layers * chunk
        # Window shards: the other half of the chunk's q, k, v in; the other rank's partial
        # states (head_dim + 1 LSE column) of this rank's half of the tokens in.
        assert shards["shard_gather"] == shape.layers * 3 * chunk / 2
        per_state = chunk * (shape.head_dim + 1) / shape.head_dim
        assert shards["shard_exchange"] == shape.layers * per_state / 2
        assert shards["ulysses"] == 0 and ulysses["shard_gather"] == 0
    for a, b in ((rows[0], rows[1]), (rows[2], rows[3])):
        assert a["bytes_per_forward"] == b["bytes_per_forward"]  # not a byte more per frame
        assert a["pool_bytes_per_rank"] < b["pool_bytes_per_rank"]  # the pools grow
    for row in rows:
        assert row["pool_bytes_per_rank"] < 0.75 * row["single_process_pool_bytes"]
    assert "window shards" in capsys.readouterr().out


def test_time_bench_runs_as_a_world_of_one(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert (
        parallel_rollout.main(
            ["time", "--tiny", "--blocks", "3", "--steps", "1", "--device", "cpu"]
        )
        == 0
    )
    fields = dict(item.split("=") for item in capsys.readouterr().out.split())
    assert fields["world"] == "1" and fields["kv_shards"] == "1"
    assert float(fields["steady_block_ms"]) > 0
