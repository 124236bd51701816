"""A diffusers Wan model rolled out on the paged cache equals the same model on a dense KV list.

Every rollout is 8 blocks (the window slides or resets several times) of a tiny random-weight
``WanTransformer3DModel`` with 24 tokens per latent frame, paged in blocks of 16 or 7 tokens
(frames begin and end mid-block). The paged latents must equal the dense float64 reference's at
every block, and each forward must have read exactly the model positions the reference read.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from paged_video.kernels.fused import write_attend
from paged_video.models import wan_paged
from paged_video.models.wan_paged import PagedWanRollout, absolute_rotary
from paged_video.paging import PagingConfig
from paged_video.reference.wan_rollout import reference_rollout
from tests.models.tiny import ATOL, RTOL, TOKENS_PER_FRAME, poison, rollout_inputs, tiny_wan

BLOCKS = 8
GUIDANCE = 3.0


def run_both(
    *,
    block_size,
    sink,
    window,
    frames,
    reset=False,
    staged=False,
    exact=True,
    guidance=True,
    sigmas=(1.0,),
    action_tokens=0,
    seed=0,
    kv_dtype=None,
    smooth_keys=True,
    keys_major=False,
    blocks=BLOCKS,
    extra=None,
    kv_format=None,
):
    """The paged and the dense rollout of one configuration. With a dict ``extra``, quantized
    runs also store the paged rollout's ``cache`` and the ``unquantized`` dense rollout there.
    The dense rollout does not model ``kv_format``: it is the unquantized one then."""
    model = tiny_wan(seed)
    inputs = rollout_inputs(frames, blocks=blocks, action_tokens=max(1, action_tokens), seed=seed)
    actions = inputs.actions if action_tokens else None
    negative = inputs.negative if guidance else None
    config = PagingConfig(
        block_size=block_size,
        chunk_size=TOKENS_PER_FRAME,
        sink_chunks=sink,
        window_chunks=window,
        max_forward_chunks=frames,
        max_action_tokens=action_tokens,
        reset_at_boundary=reset,
        reuse_history_staging=staged,
        exact_window=exact,
        kv_dtype=kv_dtype,
        smooth_keys=smooth_keys,
        keys_major=keys_major,
        kv_format=kv_format,
    )
    common = dict(frames_per_block=frames, sigmas=sigmas, guidance_scale=GUIDANCE, actions=actions)
    with PagedWanRollout(model, config, guidance=guidance) as rollout:
        poison(rollout.cache)
        free = rollout.cache.pool.num_free
        paged = rollout.generate(inputs.noise, inputs.prompt, negative, **common)
        assert rollout.cache.pool.num_free == free  # the session was closed
    common.update(
        sink_frames=sink,
        window_frames=window,
        reset_at_boundary=reset,
        read_block_size=None if exact else block_size,
    )
    text = (inputs.noise, inputs.prompt, negative)
    dense = reference_rollout(model, *text, kv_dtype=kv_dtype, smooth_keys=smooth_keys, **common)
    if extra is not None and (kv_dtype is not None or kv_format is not None):
        extra["cache"] = rollout.cache
        extra["unquantized"] = reference_rollout(model, *text, **common)
    return model, inputs, paged, dense


def assert_equal_rollouts(paged, dense, frames, branches) -> None:
    assert len(paged.reads) == len(dense.reads) == BLOCKS
    for block in range(BLOCKS):
        frame_slice = slice(block * frames, (block + 1) * frames)
        got, want = paged.latents[:, :, frame_slice], dense.latents[:, :, frame_slice]
        assert not torch.isnan(got).any(), f"block {block}: NaN latents"
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=f"block {block}")
        assert len(paged.reads[block]) == len(dense.reads[block])
        for ours, theirs in zip(paged.reads[block], dense.reads[block], strict=True):
            assert ours.commit == theirs.commit
            for branch in branches:
                assert ours.positions[branch] == theirs.positions, (block, ours.step, branch)


CFG = ("positive", "negative")


def test_sliding_window_with_sink_and_cfg():
    # Sink 1 frame, window 4 frames, 2 frames per block: the window slides from block 2 on.
    # Both CFG branches in one launch.
    model, inputs, paged, dense = run_both(block_size=16, sink=1, window=4, frames=2)
    assert_equal_rollouts(paged, dense, 2, CFG)
    last = paged.reads[-1][0].positions["positive"]
    assert last == [*range(24), *range(12 * 24, 16 * 24)]  # sink, frames 12, 13 and its own
    # The test can fail: a reference keeping one frame less differs at the first slide.
    narrower = reference_rollout(
        model,
        inputs.noise,
        inputs.prompt,
        inputs.negative,
        frames_per_block=2,
        sink_frames=1,
        window_frames=3,
        sigmas=(1.0,),
        guidance_scale=GUIDANCE,
    )
    assert (narrower.latents - paged.latents).abs().max() > 50 * ATOL


def test_no_sink_staged_single_branch_reuses_staging():
    # Without CFG one block-table row: history staging is used. The committing forward has the
    # same history as the block's denoising forward (48-token chunks on 16-token blocks), so it
    # restages only its own blocks.
    _, _, paged, dense = run_both(
        block_size=16, sink=0, window=4, frames=2, staged=True, guidance=False
    )
    assert_equal_rollouts(paged, dense, 2, ("main",))
    for block in paged.reads[1:]:
        scratch, commit = block
        assert scratch.stage_from == 0
        assert commit.stage_from > 0


def test_reset_at_boundary_blocks_of_7_with_actions():
    # Reset: everything after the sink goes at each commit. Three action tokens per block
    # (keys of every forward of their block, never committed) follow a video run that ends
    # mid-block (24-token frames on 7-token blocks).
    _, _, paged, dense = run_both(
        block_size=7, sink=1, window=3, frames=1, reset=True, action_tokens=3
    )
    assert_equal_rollouts(paged, dense, 1, CFG)
    # Every forward reads the sink and its own frame only.
    assert paged.reads[5][0].positions["negative"] == [*range(24), *range(120, 144)]
    assert all(read.action_tokens == 3 for block in paged.reads for read in block)


def test_whole_block_reads_read_the_same_boundary_tokens(monkeypatch):
    # Exact window off, B = 7, C = 24, sink 1, window 3 frames, one frame per block. At block 5
    # (frame 5, positions 120..143) the window keeps the sink 0..23 and frames 3..5 (72..143).
    # Whole blocks add boundary tokens the reference reads too: 24..27 (frame 1's first four
    # tokens, in the sink's last block 21..27, never freed) and 70..71 (frame 2's last two, in
    # block 70..76 where the recent range starts).
    launches = []

    def counted(query, *args):
        launches.append((query.shape[0], args[-1].block_table.shape[0]))
        return write_attend(query, *args)

    monkeypatch.setattr(wan_paged, "write_attend", counted)
    _, _, paged, dense = run_both(block_size=7, sink=1, window=3, frames=1, exact=False)
    assert_equal_rollouts(paged, dense, 1, CFG)
    # One fused launch per layer and forward, both CFG branches' queries and table rows in it.
    assert launches == [(2 * TOKENS_PER_FRAME, 2)] * (BLOCKS * 2 * 2)
    for read in paged.reads[5]:
        assert read.positions["positive"] == [*range(28), *range(70, 144)]


def test_stock_processor_equals_reference_at_the_first_block():
    # Anchor on diffusers itself: with no history, the stock model (all frames visible, stock
    # processors and rotary) denoises the first block exactly as the reference does.
    model = tiny_wan(3)
    inputs = rollout_inputs(2, blocks=2, seed=3)
    sigmas = (1.0, 0.75, 0.5)
    x = inputs.noise[:, :, :2]
    text = torch.cat([inputs.prompt, inputs.negative])
    with torch.no_grad():
        for step, sigma in enumerate(sigmas):
            t = torch.full((2,), 1000.0 * sigma)
            out = model(x.expand(2, -1, -1, -1, -1), t, text, return_dict=False)[0]
            flow = out[1:] + GUIDANCE * (out[:1] - out[1:])
            x = x + ((sigmas[step + 1] if step + 1 < len(sigmas) else 0.0) - sigma) * flow
    dense = reference_rollout(
        model,
        inputs.noise,
        inputs.prompt,
        inputs.negative,
        frames_per_block=2,
        sink_frames=1,
        window_frames=4,
        sigmas=sigmas,
        guidance_scale=GUIDANCE,
    )
    torch.testing.assert_close(dense.latents[:, :, :2], x, atol=ATOL, rtol=RTOL)
    # The processors were put back: the model still runs stock.
    assert type(model.blocks[0].attn1.processor).__name__ == "WanAttnProcessor"


def test_absolute_rotary_is_the_stock_table_at_later_frames():
    rope = tiny_wan().rope
    cos, sin = rope(torch.empty(1, 1, 7, 8, 12, device="meta"))
    got_cos, got_sin = absolute_rotary(rope, 5, 2, 4, 6)
    assert torch.equal(got_cos, cos[:, 5 * 24 :]) and torch.equal(got_sin, sin[:, 5 * 24 :])
    assert not torch.equal(got_cos, cos[:, : 2 * 24])
    with pytest.raises(ValueError, match="rope_max_seq_len"):
        absolute_rotary(rope, 63, 2, 4, 6)


def test_bad_input_names_the_argument_and_changes_nothing():
    model = tiny_wan()
    inputs = rollout_inputs(1, blocks=2)
    config = PagingConfig(block_size=16, chunk_size=TOKENS_PER_FRAME, window_chunks=2)
    rollout = PagedWanRollout(model, config)
    free = rollout.cache.pool.num_free
    cases = [
        ((inputs.noise, inputs.prompt, None), {"frames_per_block": 1}, "negative_prompt_embeds"),
        (
            (inputs.noise, inputs.prompt, inputs.negative),
            {"frames_per_block": 2},
            "max_forward_chunks",
        ),
        (
            (inputs.noise[:, :, :, :6], inputs.prompt, inputs.negative),
            {"frames_per_block": 1},
            "chunk_size",
        ),
        (
            (inputs.noise, inputs.prompt, inputs.negative),
            {"frames_per_block": 1, "sigmas": (0.5, 1.0)},
            "sigmas",
        ),
        (
            (inputs.noise, inputs.prompt, inputs.negative),
            {"frames_per_block": 1, "actions": inputs.actions},
            "actions",
        ),
    ]
    for args, kwargs, name in cases:
        with pytest.raises(ValueError, match=name):
            rollout.generate(*args, **kwargs)
    assert rollout.cache.pool.num_free == free and not rollout.cache.sessions
    with pytest.raises(TypeError, match="config"):
        PagedWanRollout(model, object())
    rollout.close()
    assert type(model.blocks[1].attn1.processor).__name__ == "WanAttnProcessor"


def test_projection_step_refuses_rotary_tables_of_other_tokens():
    # project() is the step a parallel processor keeps: its rotary tables must match the
    # tokens it was given (a Ulysses rank gets its shard of both), else a ValueError.
    model = tiny_wan()
    processor = wan_paged.PagedWanAttnProcessor(wan_paged.ForwardState(), 0)
    hidden = torch.randn(1, 24, 64)
    cos, sin = model.rope(torch.empty(1, 1, 2, 8, 12, device="meta"))  # 48 tokens' tables
    with pytest.raises(ValueError, match="rotary_emb"):
        processor.project(model.blocks[0].attn1, hidden, (cos, sin))
    query, key, value = processor.project(model.blocks[0].attn1, hidden, (cos[:, :24], sin[:, :24]))
    assert query.shape == key.shape == value.shape == (1, 24, 2, 32)
