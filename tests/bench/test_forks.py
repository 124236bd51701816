"""``python -m paged_video.bench.forks``: K forks of a full window hold the window once plus what
each fork wrote (its new blocks and one copied tail block per branch), worked by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paged_video.bench.forks import main, run_forks
from paged_video.paging import PagingConfig

# C = 6, B = 4, sink 1 + window 3 frames: the fork point holds 30 tokens per branch, entries
# 0..7 less entry 2 (evicted), so 7 blocks; its tail block (28..31) is half written.
CONFIG = PagingConfig(block_size=4, chunk_size=6, sink_chunks=1, window_chunks=3)
SMALL = ["--block-size", "4", "--chunk-size", "6", "--frames-per-block", "1"]
SMALL += ["--sink-frames", "1", "--window-frames", "3", "--layers", "1", "--kv-heads", "1"]
SMALL += ["--head-dim", "4", "--steps", "1"]


@pytest.mark.parametrize("futures", [1, 3])
def test_forks_hold_one_window_plus_what_each_wrote(futures: int) -> None:
    run = run_forks(
        CONFIG,
        futures=futures,
        blocks=1,
        steps=2,
        frames_per_block=1,
        layers=1,
        kv_heads=1,
        head_dim=4,
        dtype=torch.bfloat16,
    )
    # Each fork writes 30..35 per branch: a copy of block 28..31 and a new block 32..35.
    assert run.window_blocks == 2 * 7 and run.written_blocks == [2 * 2] * futures
    assert run.copied_blocks == 2 * futures
    assert run.held_blocks == run.peak_blocks == 14 + 4 * futures
    # Separate sessions: the fork point's 7 and each fork's 8 entries, less entry 3 it evicted.
    assert run.separate_blocks == 14 + 2 * 7 * futures
    assert run.block_bytes == 2 * 4 * 4 * 2  # K and V, B slots of head_dim 4, bf16


def test_the_command_prints_one_row_per_k(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--futures", "1", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].split()[:4] == ["K", "window", "written/fork", "copied"]
    assert [line.split()[:6] for line in out[3:]] == [
        ["1", "14", "4", "2", "18", "0.00"],
        ["2", "14", "4", "4", "22", "0.00"],
    ]
    with pytest.raises(SystemExit):
        main([*SMALL, "--futures", "0"])


# Per format, one block's bytes over bf16's at head_dim 128 and block 16 (K and V codes, their
# scales; keys-major rows are padded to 16 keys, so smaller blocks pay more, docs/quantization.md).
BLOCK_SHARE = {"int8": (0.5, 0.52), "k8v8": (0.5, 0.51), "k8v16": (0.75, 0.76)}


@pytest.mark.parametrize("kv_format", ["int8", "k8v8", "k8v16"])
def test_quantized_pools_hold_the_same_blocks(kv_format: str, capsys) -> None:
    # Nothing is written: the run must not stop at a forward over committed tokens whose
    # layers' mean, factors and (k8v8) V channel scales no write chose (the cache refuses those).
    assert main([*SMALL, "--futures", "2", "--kv-format", kv_format]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"x 4, {kv_format}, C=6" in out[0]
    assert out[3].split()[:5] == ["2", "14", "4", "4", "22"]
    # The bytes are the format's: codes and scales at head_dim 128 against bf16's.
    runs = {
        name: run_forks(
            dataclasses.replace(CONFIG, block_size=16, kv_format=name),
            futures=1,
            blocks=1,
            steps=1,
            frames_per_block=1,
            layers=1,
            kv_heads=2,
            head_dim=128,
            dtype=torch.bfloat16,
        )
        for name in ("bf16", kv_format)
    }
    low, high = BLOCK_SHARE[kv_format]
    share = runs[kv_format].block_bytes / runs["bf16"].block_bytes
    assert low <= share <= high, share
    assert runs[kv_format].held_blocks == runs["bf16"].held_blocks


def test_the_deleted_e4m3_pool_names_its_replacements(capsys) -> None:
    with pytest.raises(SystemExit):
        main([*SMALL, "--futures", "2", "--kv-dtype", "float8_e4m3fn"])
    assert "(the e4m3 dequantizing pool) was deleted" in capsys.readouterr().err
