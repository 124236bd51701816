"""Wan transformer blocks with the paged processor compile to one graph for the whole rollout."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from paged_video.models.wan_paged import PagedWanRollout
from paged_video.paging import PagingConfig
from paged_video.reference.wan_rollout import reference_rollout
from tests.models.tiny import (
    ATOL,
    RTOL,
    TOKENS_PER_FRAME,
    assert_close_to_quantized_oracle,
    rollout_inputs,
    tiny_wan,
)


@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["float", "int8"])
def test_compiled_blocks_share_one_graph_over_the_rollout(kv_dtype):
    # Every block compiled with fullgraph=True (no graph break: the fused op is one custom op)
    # runs every forward of a sliding rollout (two denoising forwards and a committing one per
    # block): scratch and committing plans, new block ids and slots, a longer history, other
    # timesteps and rotary positions, and both layers (the layer index is a tensor). One graph
    # in all, and the same latents as the dense reference. With int8 pools the op also writes
    # scales and chooses each layer's K mean (a flag on the device, not a guard).
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    model = tiny_wan(4)
    inputs = rollout_inputs(1, blocks=4, seed=4)
    config = PagingConfig(
        block_size=16,
        chunk_size=TOKENS_PER_FRAME,
        sink_chunks=1,
        window_chunks=2,
        exact_window=True,
        kv_dtype=kv_dtype,
    )
    counter = CompileCounter()
    with PagedWanRollout(model, config) as rollout:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, fullgraph=True, backend=counter)
        paged = rollout.generate(
            inputs.noise, inputs.prompt, inputs.negative, frames_per_block=1, sigmas=(1.0, 0.5)
        )
    assert counter.frame_count == 1
    assert counter.op_count > 10  # the block itself was captured, not an empty graph
    for i, block in enumerate(model.blocks):
        model.blocks[i] = block._orig_mod
    text = (inputs.noise, inputs.prompt, inputs.negative)
    window = dict(frames_per_block=1, sink_frames=1, window_frames=2, sigmas=(1.0, 0.5))
    dense = reference_rollout(model, *text, kv_dtype=kv_dtype, **window)
    if kv_dtype is None:
        torch.testing.assert_close(paged.latents, dense.latents, atol=ATOL, rtol=RTOL)
    else:
        plain = reference_rollout(model, *text, **window).latents
        assert_close_to_quantized_oracle(paged.latents, dense.latents, plain, "compiled, int8")
