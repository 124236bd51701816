"""The Wan rollout over quantized pools (``PagingConfig(kv_dtype=...)``) end to end.

The oracle is the dense reference whose attention reads the same quantized K/V
(``reference_rollout(kv_dtype=...)``: ``reference.quantize`` codes times scales in float64, keys
smoothed by each layer's mean of its first write, as the cache chooses it). Against it the
rollout must agree up to code flips at rounding ties (``assert_close_to_quantized_oracle`` says
why and how much); against the unquantized reference only loosely: that difference is the
quantization's, measured and bounded here, not a bug.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from paged_video.models.wan_paged import PagedWanRollout
from paged_video.paging import PagingConfig
from paged_video.reference.wan_rollout import reference_rollout
from tests.models.test_wan_rollout import BLOCKS, CFG, run_both
from tests.models.tiny import (
    ATOL,
    TOKENS_PER_FRAME,
    assert_close_to_quantized_oracle,
    rollout_inputs,
    tiny_wan,
)

QUANTIZED = [torch.int8]
# The quantized rollout against the unquantized reference (same model and inputs), measured on
# this test's rollout: largest difference 1.2e-3, mean 1.5e-4, latents of mean magnitude 0.95.
# Bounds at about twice that.
UNQUANTIZED_MAX = {torch.int8: 3e-3}
UNQUANTIZED_MEAN = {torch.int8: 3e-4}
# kv_format rollouts against the unquantized reference (test_k8_format_rollouts_..., one branch,
# 3 blocks, under the interpreter): largest difference 1.5e-3 (k8v8) and 4.4e-4 (k8v16), mean
# 3.2e-4 and 7.7e-5, latents of mean magnitude about 0.95; bounds at about twice that.
K8_MAX = {"k8v8": 3e-3, "k8v16": 9e-4}
K8_MEAN = {"k8v8": 6.5e-4, "k8v16": 1.6e-4}


def assert_same_reads(paged, dense, branches) -> None:
    for block in range(BLOCKS):
        for ours, theirs in zip(paged.reads[block], dense.reads[block], strict=True):
            assert ours.commit == theirs.commit
            for branch in branches:
                assert ours.positions[branch] == theirs.positions, (block, ours.step, branch)


@pytest.mark.parametrize("kv_dtype", QUANTIZED, ids=["int8"])
def test_sliding_window_rollout_on_quantized_pools(kv_dtype):
    # Sink 1 frame, window 4, 2 frames per block, blocks of 16 tokens, both CFG branches: the
    # window slides and evicts from block 2 on; 8 blocks; unwritten pool slots NaN.
    extra = {}
    _, _, paged, dense = run_both(
        block_size=16, sink=1, window=4, frames=2, kv_dtype=kv_dtype, extra=extra
    )
    cache, plain = extra["cache"], extra["unquantized"]
    assert cache.k_pools.dtype == cache.v_pools.dtype == kv_dtype
    assert_same_reads(paged, dense, CFG)
    assert_close_to_quantized_oracle(paged.latents, dense.latents, plain.latents, str(kv_dtype))
    # The cache chose the reference's K means: per layer and head, from the first write.
    assert cache.k_means_chosen.all()
    for layer, mean in enumerate(dense.key_means):
        torch.testing.assert_close(cache.k_means[layer], mean, atol=1e-6, rtol=1e-6)
    # int8 equalizes channels by default: the cache chose the reference's factors.
    assert (dense.equalizers is not None) == (kv_dtype == torch.int8)
    if dense.equalizers is not None:
        assert cache.equalizers_chosen.all()
        for layer, (k_factor, v_factor) in enumerate(dense.equalizers):
            assert torch.equal(cache.k_equalizers[layer], k_factor)
            assert torch.equal(cache.v_equalizers[layer], v_factor)

    # Against the unquantized rollout: close, but not equal (the pools really were quantized).
    diff = (paged.latents - plain.latents).abs()
    assert diff.max().item() > 10 * ATOL
    assert diff.max().item() <= UNQUANTIZED_MAX[kv_dtype], diff.max().item()
    assert diff.mean().item() <= UNQUANTIZED_MEAN[kv_dtype], diff.mean().item()


def test_int8_rollout_staged_reset_whole_blocks_of_7_with_actions():
    # 24-token frames on 7-token blocks (frames start and end mid-block); no CFG, so one table
    # row and the window is restaged into history staging (codes and scales); reset at each
    # commit with a sink; whole-block reads (boundary tokens read too); 3 action tokens per
    # block (written to scratch slots, quantized too); keys quantized without smoothing.
    extra = {}
    _, _, paged, dense = run_both(
        block_size=7,
        sink=1,
        window=3,
        frames=1,
        reset=True,
        staged=True,
        exact=False,
        guidance=False,
        action_tokens=3,
        seed=2,
        kv_dtype=torch.int8,
        smooth_keys=False,
        extra=extra,
    )
    assert not extra["cache"].k_means.numel()
    assert_same_reads(paged, dense, ("main",))
    plain = extra["unquantized"].latents
    assert_close_to_quantized_oracle(paged.latents, dense.latents, plain, "int8")
    assert all(read.stage_from >= 0 for block in paged.reads[1:] for read in block)


@pytest.mark.parametrize("kv_format", ["k8v8", "k8v16"])
def test_k8_format_rollouts_run_stay_near_and_stage_bit_for_bit(kv_format):
    # PagingConfig(kv_format=...): int8 query rows and K codes (and k8v8's e4m3 probabilities
    # and V), which no dense oracle models: loose, measured bounds against the unquantized
    # rollout (3 blocks, the window slides at block 2), then (k8v8; k8v16's staging is
    # tests/paging/test_forward_staging.py's) the same rollout with history staging (from the
    # second block on: one branch, so single-row forwards) equal bit for bit.
    geometry = dict(
        block_size=16, sink=1, window=4, frames=2, blocks=3, guidance=False, kv_format=kv_format
    )
    extra = {}
    _, _, paged, dense = run_both(**geometry, extra=extra)
    cache = extra["cache"]
    assert cache.k_pools.dtype == torch.int8 and cache.config.kv_format == kv_format
    assert not torch.isnan(paged.latents).any()
    diff = (paged.latents - dense.latents).abs()
    assert diff.max().item() <= K8_MAX[kv_format], diff.max().item()
    assert diff.mean().item() <= K8_MEAN[kv_format], diff.mean().item()
    assert diff.max().item() > 0  # the format reached the kernels
    if kv_format == "k8v16":
        return
    _, _, staged, _ = run_both(**geometry, staged=True)
    assert all(read.stage_from >= 0 for block in staged.reads[1:] for read in block)
    assert torch.equal(staged.latents, paged.latents)


def test_reference_refuses_an_unknown_kv_dtype():
    inputs = rollout_inputs(1, blocks=1)
    with pytest.raises(ValueError, match="kv_dtype"):
        reference_rollout(
            tiny_wan(),
            inputs.noise,
            inputs.prompt,
            frames_per_block=1,
            sink_frames=1,
            window_frames=2,
            kv_dtype=torch.float16,
        )


def test_a_k8v8_block_whose_v_was_not_held_raises_at_its_end():
    # The rollout checks the cache's count of V its frozen scales could not hold after each
    # block (PagedKVCache.check_v_saturation); a count appearing after block 0 (as a write
    # saturating it would leave it) stops the rollout at the end of block 1.
    config = PagingConfig(
        block_size=16,
        chunk_size=TOKENS_PER_FRAME,
        sink_chunks=1,
        window_chunks=2,
        max_forward_chunks=1,
        kv_format="k8v8",
    )
    inputs = rollout_inputs(1, blocks=3)
    done = []

    def on_block(block: int) -> None:
        done.append(block)
        rollout.cache.v_saturated[1] = 5

    with PagedWanRollout(tiny_wan(0), config, guidance=False) as rollout:
        free = rollout.cache.pool.num_free
        with pytest.raises(ValueError, match=r"k8v8 stored 5 V elements .*\{1: 5\}"):
            rollout.generate(inputs.noise, inputs.prompt, frames_per_block=1, sigmas=(1.0,),
                             on_block=on_block)  # fmt: skip
        assert rollout.cache.pool.num_free == free  # the session was closed
    assert done == [0]
