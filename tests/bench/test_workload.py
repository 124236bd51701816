"""The benchmark workload pages the logical K/V faithfully, and the baselines' inputs are right."""

from __future__ import annotations

import warnings

import pytest
import torch

from paged_video.bench.providers import flex_key_tile, flex_mask_block, flex_paged_inputs
from paged_video.bench.workload import (
    Geometry,
    make_workload,
    oracle_attention,
    oracle_pools,
    oracle_stage,
)
from paged_video.reference.attention import gather_sequence

GEOMETRY = Geometry(
    chunk_size=10,
    frames=2,
    sink_chunks=1,
    window_chunks=3,
    heads=4,
    kv_heads=2,
    head_dim=8,
    dtype="fp32",
    batch=2,
)


@pytest.mark.parametrize("block_size", [1, 7, 16, 40, 64])
def test_the_pool_pages_the_logical_keys_in_distinct_random_blocks(block_size):
    w = make_workload(GEOMETRY, block_size, seed=3)
    used = w.block_table.reshape(-1)
    assert used.unique().numel() == used.numel() and int(used.min()) >= 1  # block 0 is null
    assert w.block_table.dtype == torch.int32
    for seq in range(GEOMETRY.batch):
        keys = gather_sequence(w.k_cache, w.block_table[seq], GEOMETRY.kv_tokens)
        values = gather_sequence(w.v_cache, w.block_table[seq], GEOMETRY.kv_tokens)
        assert torch.equal(keys, w.keys[seq]) and torch.equal(values, w.values[seq])
    assert w.cu_seqlens_q.tolist() == [0, 20, 40]
    assert w.seq_lens_k.tolist() == [40, 40]


def test_write_slots_target_each_sequences_last_chunk():
    w = make_workload(GEOMETRY, 16)
    k_pool, _ = oracle_pools(w)
    for seq in range(GEOMETRY.batch):
        keys = gather_sequence(k_pool.view(w.k_cache.shape), w.block_table[seq], 40)
        assert torch.equal(keys[:20], w.keys[seq, :20])  # the history is untouched
        assert torch.equal(keys[20:], w.new_keys[seq * 20 : (seq + 1) * 20])


def test_the_stage_oracle_holds_whole_blocks_row_after_row():
    w = make_workload(GEOMETRY, 16)
    stage_k, stage_v = oracle_stage(w)
    assert stage_k.shape == (2 * 48, 2, 8)
    assert torch.equal(stage_k[:40], w.keys[0]) and torch.equal(stage_v[48:88], w.values[1])


def test_the_data_and_the_oracle_do_not_depend_on_the_block_size():
    small, large = make_workload(GEOMETRY, 3), make_workload(GEOMETRY, 32)
    assert torch.equal(small.q, large.q) and torch.equal(small.keys, large.keys)
    assert not torch.equal(small.block_table[:, :1], large.block_table[:, :1])
    torch.testing.assert_close(oracle_attention(small), oracle_attention(large), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("block_size", "mask_block", "tile"),
    [(1, 128, 64), (8, 128, 64), (16, 16, 16), (24, 128, 64), (48, 48, 16), (256, 256, 64)]
    + [(520, 128, 64), (1560, 128, 64)],
)
def test_flex_takes_every_block_size(block_size, mask_block, tile):
    """Cache blocks of a multiple of 16 keys are the mask's blocks; others are covered by
    128-slot mask blocks, partial where they straddle; the key tile divides the mask block."""
    assert flex_mask_block(block_size) == mask_block
    assert flex_key_tile(block_size) == tile


@pytest.mark.parametrize("block_size", [7, 16, 24])
def test_flex_paged_inputs_match_the_oracle_in_eager_mode(block_size):
    from torch.nn.attention.flex_attention import flex_attention

    w = make_workload(GEOMETRY, block_size)
    q, k, v, block_mask = flex_paged_inputs(w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it is not compiled
        out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    packed = out.transpose(1, 2).reshape(w.q.shape)
    torch.testing.assert_close(packed.double(), oracle_attention(w), atol=1e-5, rtol=1e-5)
