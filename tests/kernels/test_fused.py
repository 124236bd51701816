"""The fused write+attend custom op: schema, idempotent registration, one compiled graph, and
bit-for-bit agreement with calling the kernels directly."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from paged_video import kernels
from paged_video.kernels import fused
from tests.helpers import DEVICE

LAYERS, BLOCKS, BLOCK, KV_HEADS, HEADS, DIM, WIDTH = 3, 12, 16, 2, 4, 32, 5


def make_state(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (LAYERS, BLOCKS, BLOCK, KV_HEADS, DIM)
    k_pools = torch.randn(shape, generator=gen).to(DEVICE)
    v_pools = torch.randn(shape, generator=gen).to(DEVICE)
    stage_k = torch.full((LAYERS, WIDTH * BLOCK, KV_HEADS, DIM), float("nan"), device=DEVICE)
    stage_v = stage_k.clone()
    return k_pools, v_pools, stage_k, stage_v


def make_forward(step: int, *, staged: bool, layer: int = 0, return_lse: bool = False):
    """A forward whose block table, slots and history length all depend on ``step``."""
    gen = torch.Generator().manual_seed(100 + step)
    num_q, num_action = 20, 3
    table = (torch.randperm(BLOCKS - 1, generator=gen)[:WIDTH] + 1).to(torch.int32).view(1, -1)
    history = 17 + 9 * step
    # Video tokens continue the history (possibly mid-block); action tokens go after them.
    positions = torch.arange(history, history + num_q)
    video_slots = table[0, positions // BLOCK].long() * BLOCK + positions % BLOCK
    action_positions = torch.arange(num_action) + (history + num_q)
    action_slots = table[0, action_positions // BLOCK].long() * BLOCK + action_positions % BLOCK
    inputs = fused.LayerInputs(
        layer=torch.tensor(layer),
        video_slots=video_slots.to(DEVICE),
        action_slots=action_slots.to(DEVICE),
        block_table=table.to(DEVICE),
        cu_seqlens_q=torch.tensor([0, num_q], dtype=torch.int32, device=DEVICE),
        seq_lens_k=torch.tensor([history + num_q + num_action], dtype=torch.int32, device=DEVICE),
        key_gap=torch.tensor([[[3, 9]]], dtype=torch.int32, device=DEVICE),
        stage_from=torch.tensor(0 if staged else -1),
        stage_key=torch.tensor(-1),
        stage_tags=torch.full((LAYERS,), -1),
        max_seqlen_q=num_q,
        softmax_scale=DIM**-0.5,
        return_lse=return_lse,
    )
    tensors = [
        torch.randn(n, h, DIM, generator=gen).to(DEVICE)
        for n, h in (
            (num_q, HEADS),
            (num_q, KV_HEADS),
            (num_q, KV_HEADS),
            (num_action, KV_HEADS),
            (num_action, KV_HEADS),
        )
    ]
    return tensors, inputs


def direct_calls(tensors, inputs, pools: fused.PoolTensors, mean=None, equalizers=None):
    """The op's work by hand: the three kernels, with ``mean`` as the K smoothing and
    ``equalizers`` (K's and V's factors) as the channel equalization.

    Scales are passed only for quantized pools (the zero-size ones of float pools are not).
    """
    query, key, value, action_key, action_value = tensors
    layer = int(inputs.layer)
    k_cache, v_cache = pools.k_pools[layer], pools.v_pools[layer]
    quantized = pools.k_scales.numel() > 0
    k_scale = pools.k_scales[layer] if quantized else None
    v_scale = pools.v_scales[layer] if quantized else None
    flat = (k_cache.flatten(0, 1), v_cache.flatten(0, 1))
    scales = {}
    if quantized:
        scales = {"k_scale": k_scale.flatten(0, 1), "v_scale": v_scale.flatten(0, 1)}
        scales["k_smooth"] = mean
    factors = {}
    if equalizers is not None:
        factors = {"k_equalizer": equalizers[0], "v_equalizer": equalizers[1]}
    kernels.write_slots(key, value, *flat, inputs.video_slots, **scales, **factors)
    kernels.write_slots(action_key, action_value, *flat, inputs.action_slots, **scales, **factors)
    cache_k, cache_v, table = k_cache, v_cache, inputs.block_table
    if int(inputs.stage_from) >= 0:
        stage = (pools.stage_k_scales[layer], pools.stage_v_scales[layer]) if quantized else None
        stage_scales = {}
        if quantized:
            stage_scales = dict(
                k_scale=k_scale, v_scale=v_scale, stage_k_scale=stage[0], stage_v_scale=stage[1]
            )
        kernels.gather_blocks(
            k_cache,
            v_cache,
            inputs.block_table[0],
            pools.stage_k[layer],
            pools.stage_v[layer],
            first_block=int(inputs.stage_from),
            **stage_scales,
        )
        # The staged window as the pools' blocks, in table order: the paged call's launch.
        width = inputs.block_table.shape[1]
        blocks = (width, k_cache.shape[1])
        cache_k, cache_v = (t[layer].unflatten(0, blocks) for t in (pools.stage_k, pools.stage_v))
        if quantized:
            k_scale, v_scale = (t.unflatten(0, blocks) for t in stage)
        table = torch.arange(width, dtype=torch.int32, device=DEVICE).view(1, -1)
    return kernels.paged_attention(
        query,
        cache_k,
        cache_v,
        table,
        inputs.cu_seqlens_q,
        inputs.seq_lens_k,
        max_seqlen_q=inputs.max_seqlen_q,
        softmax_scale=inputs.softmax_scale,
        key_gap=inputs.key_gap,
        k_scale=k_scale,
        v_scale=v_scale,
        return_lse=inputs.return_lse,
        **factors,
    )


def test_schema_declares_mutations_without_defaults() -> None:
    schema = fused.write_attend_op._schema
    mutated = {arg.name for arg in schema.arguments if arg.alias_info and arg.alias_info.is_write}
    assert mutated == set(fused.MUTATED_ARGS)
    for arg in schema.arguments:
        assert not arg.has_default_value(), f"{arg.name} has a default"
    # (out, lse): one output list whether or not the LSE is asked for.
    assert [str(ret.type) for ret in schema.returns] == ["Tensor", "Tensor"]


def test_reimport_is_idempotent() -> None:
    before = fused.write_attend_op
    reloaded = importlib.reload(fused)
    assert reloaded.write_attend_op is before
    assert torch.ops.paged_video.write_attend.default is before


def test_fake_returns_query_shape() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    state = make_state()
    tensors, inputs = make_forward(0, staged=False)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(t) for t in (*tensors, *state)]
        pools = fused.PoolTensors.build(*fake[5:])
        out = fused.write_attend(*fake[:5], pools, inputs)
        with_lse = fused.write_attend(*fake[:5], pools, inputs._replace(return_lse=True))
    assert out.shape == tensors[0].shape and out.dtype == tensors[0].dtype
    out, lse = with_lse
    assert out.shape == tensors[0].shape
    assert lse.shape == tensors[0].shape[:2] and lse.dtype == torch.float32


def test_return_lse_must_be_a_bool() -> None:
    # The dispatcher would turn 1 into True; the refusal comes first and writes nothing.
    state = make_state()
    before = [t.clone() for t in state]
    tensors, inputs = make_forward(0, staged=False)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        fused.write_attend(*tensors, fused.PoolTensors.build(*state), inputs._replace(return_lse=1))
    for a, b in zip(state, before, strict=True):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@pytest.mark.parametrize("staged", [False, True], ids=["paged", "staged"])
def test_matches_direct_kernel_calls_bit_for_bit(staged: bool) -> None:
    # The second step also returns the LSE: the direct call's, bit for bit.
    for step in range(2):
        tensors, inputs = make_forward(step, staged=staged, layer=step + 1, return_lse=step == 1)
        state_op, state_direct = make_state(), make_state()
        got = fused.write_attend(*tensors, fused.PoolTensors.build(*state_op), inputs)
        want = direct_calls(tensors, inputs, fused.PoolTensors.build(*state_direct))
        assert isinstance(got, tuple) == (step == 1)
        for a, b in zip(*((got, want) if step == 1 else ((got,), (want,))), strict=True):
            assert torch.equal(a, b)
        for a, b in zip(state_op, state_direct, strict=True):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), "mutated state differs"


@pytest.mark.parametrize(
    "staged, return_lse",
    [(False, False), (True, False), (True, True)],
    ids=["paged", "staged", "staged-lse"],
)
def test_compiles_once_across_changing_values(staged: bool, return_lse: bool) -> None:
    pools = fused.PoolTensors.build(*make_state())

    def block(tensors, inputs):
        query, key, value, action_key, action_value = tensors
        result = fused.write_attend(
            query * 1.5,
            key,
            value,
            action_key,
            action_value,
            pools,
            inputs,
        )
        if inputs.return_lse:
            out, lse = result
            return out.sum(dim=1), lse * 2.0
        return result.sum(dim=1)

    counter = CompileCounter()
    compiled = torch.compile(block, fullgraph=True, backend=counter)
    for step in range(3):
        # Block tables, slots, history lengths and the layer all change value.
        tensors, inputs = make_forward(step, staged=staged, layer=step, return_lse=return_lse)
        twin = fused.PoolTensors.build(*make_state())
        want = direct_calls([tensors[0] * 1.5, *tensors[1:]], inputs, twin)
        got = compiled(tensors, inputs)
        if return_lse:
            torch.testing.assert_close(got[0], want[0].sum(dim=1), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(got[1], want[1] * 2.0, rtol=1e-6, atol=1e-6)
        else:
            torch.testing.assert_close(got, want.sum(dim=1), rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1


def test_a_staged_call_without_a_history_id_restages_all() -> None:
    # stage_key -1 names no history: even over a layer whose tag is -1 too, the op restages
    # every block, not only those from stage_from on (the rows before it hold NaN here).
    tensors, inputs = make_forward(0, staged=True, layer=1)
    state = make_state()
    out = fused.write_attend(
        *tensors, fused.PoolTensors.build(*state), inputs._replace(stage_from=torch.tensor(2))
    )
    assert not out.isnan().any()
    assert not state[2][1, : 2 * BLOCK].isnan().any(), "the first blocks were not restaged"
    assert int(inputs.stage_tags[1]) == -1


@pytest.mark.parametrize(
    "change, match",
    [
        pytest.param(  # two rows, consistent lengths: only the staging check refuses
            lambda i: i._replace(
                block_table=i.block_table.repeat(2, 1),
                cu_seqlens_q=torch.tensor([0, 10, 20], dtype=torch.int32, device=DEVICE),
                seq_lens_k=i.seq_lens_k.repeat(2),
                key_gap=i.key_gap.repeat(2, 1, 1),
            ),
            "block_table must have one row with history staging",
            id="two-rows",
        ),
        pytest.param(
            lambda i: i._replace(block_table=torch.cat([i.block_table, i.block_table], 1)),
            "rows per layer",
            id="window-too-wide",
        ),
    ],
)
def test_staging_needs_one_row_and_room_for_the_window(change, match: str) -> None:
    tensors, inputs = make_forward(0, staged=True)
    state = make_state()
    before = [t.clone() for t in state]
    with pytest.raises(ValueError, match=match):
        fused.write_attend(*tensors, fused.PoolTensors.build(*state), change(inputs))
    for now, then in zip(state, before, strict=True):
        assert torch.equal(now.nan_to_num(7.0), then.nan_to_num(7.0))


def test_pool_tensors_and_query_heads_are_checked() -> None:
    state = make_state()
    with pytest.raises(TypeError, match=r"unknown pool tensors \['k_scale'\]"):
        fused.PoolTensors.build(*state, k_scale=torch.zeros(1))
    with pytest.raises(TypeError, match=r"k_pools must be a torch\.Tensor"):
        fused.PoolTensors.build([0.0], *state[1:])
    tensors, inputs = make_forward(0, staged=False)
    tensors[0] = tensors[0][:, :3]  # 3 query heads over 2 KV heads
    before = state[0].clone()
    with pytest.raises(ValueError, match="query num_heads 3 must be a multiple of num_kv_heads 2"):
        fused.write_attend(*tensors, fused.PoolTensors.build(*state), inputs)
    assert torch.equal(state[0], before)
