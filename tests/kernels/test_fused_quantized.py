"""The fused write+attend op over quantized pools (int8 codes, float32 scales, K means).

Checked against: the three kernels called by hand with the mean the op chose (bit for bit),
the float64 oracle over the dequantized pools, the float64 mean of the keys, eager calls of the
op (compiled, with no recompile as the layer, slots and staging ids change), and a snapshot of
every cache tensor after a refused call.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from paged_video import kernels
from paged_video.kernels import fused
from paged_video.reference.quantize import K_SHARE, channel_factors, nearest_code_error, quantize
from tests.helpers import DEVICE
from tests.kernels.test_fused import (
    BLOCK,
    BLOCKS,
    DIM,
    KV_HEADS,
    LAYERS,
    WIDTH,
    direct_calls,
    make_forward,
)

# The pools with a scale per slot (the e4m3 one was deleted, issue 45: test_e4m3_pool_refused).
FORMATS = [pytest.param(torch.int8, id="int8")]
POISON = {torch.int8: -128}  # int8's never-written code
ATOL = 2e-5


def make_state(dtype: torch.dtype, seed: int = 0, equalize: bool = False) -> fused.PoolTensors:
    """Pools of quantized random K/V; staging buffers, their scales and the means poisoned
    (NaN scales and means, NaN / never-written codes), no mean chosen; with ``equalize``,
    factors poisoned too (NaN), none chosen."""
    gen = torch.Generator().manual_seed(seed)
    shape = (LAYERS, BLOCKS, BLOCK, KV_HEADS, DIM)
    (k_pools, k_scales), (v_pools, v_scales) = (
        quantize(torch.randn(shape, generator=gen) * 3, dtype) for _ in range(2)
    )
    stage_k = torch.empty(LAYERS, WIDTH * BLOCK, KV_HEADS, DIM, dtype=dtype)
    stage_k.view(torch.int8).fill_(POISON[dtype])
    stage_scales = torch.full(stage_k.shape[:-1], float("nan"))
    on_device = (
        k_pools,
        v_pools,
        stage_k,
        stage_k.clone(),
        k_scales,
        v_scales,
        stage_scales,
        stage_scales.clone(),
        torch.full((LAYERS, KV_HEADS, DIM), float("nan")),
    )
    # The flags stay on the CPU: the op reads them without a device sync.
    flags = torch.zeros(LAYERS, dtype=torch.bool)
    factor_shape = (LAYERS, KV_HEADS, DIM) if equalize else (0,)
    factors = [torch.full(factor_shape, float("nan"), device=DEVICE) for _ in range(2)]
    equalized = torch.zeros(LAYERS if equalize else 0, dtype=torch.bool)
    # No k8v8 state (V's channel scales, their flags and saturation counts): zero-size.
    k8v8 = (
        torch.empty(0, device=DEVICE),
        torch.empty(0, dtype=torch.bool),
        torch.empty(0, dtype=torch.int32, device=DEVICE),
    )
    return fused.PoolTensors(*(t.to(DEVICE) for t in on_device), flags, *factors, equalized, *k8v8)


def forward(step: int, *, staged: bool, layer: int):
    """``make_forward``'s inputs with keys offset per channel (what smoothing removes), and two
    key and two value channels 30x wider, token by token (what channel equalization evens
    out)."""
    tensors, inputs = make_forward(step, staged=staged, layer=layer)
    offsets = torch.linspace(-20, 20, DIM, device=DEVICE)
    k_gains, v_gains = torch.ones(2, DIM, device=DEVICE)
    k_gains[[2, 5]] = 30.0
    v_gains[[1, 6]] = 30.0
    tensors[1] = tensors[1] * k_gains + offsets
    tensors[3] = tensors[3] * k_gains + offsets
    tensors[2] = tensors[2] * v_gains
    tensors[4] = tensors[4] * v_gains
    return tensors, inputs


def clone(pools: fused.PoolTensors) -> fused.PoolTensors:
    return fused.PoolTensors(*(t.clone() for t in pools))


def equal(a: fused.PoolTensors, b: fused.PoolTensors) -> bool:
    """Bitwise, NaN included (fields None in both are skipped)."""
    return all(
        (x is None and y is None) or torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def test_non_finite_keys_are_left_out_of_the_mean() -> None:
    state = make_state(torch.int8)
    tensors, inputs = forward(0, staged=False, layer=0)
    key = tensors[1]
    key[3, 0, 5] = float("nan")
    key[4, 1, 6] = float("inf")
    fused.write_attend(*tensors, state, inputs)
    mean = state.k_means[0].double()
    assert torch.isfinite(mean).all()
    finite = key.double().isfinite()
    count = finite.sum(0)
    want = torch.where(finite, key.double(), 0.0).sum(0) / count
    # A float32 sum in any order (a GPU's reduction tree is not the CPU's) is within (n - 1)
    # units of roundoff of the sum of magnitudes, the division half a unit more: up to 3.3e-5
    # here, where a fixed 1e-5 stood (50 random orders of sequential sums reached 5.7e-6).
    unit = 2.0**-24
    magnitudes = torch.where(finite, key.double().abs(), 0.0).sum(0)
    bound = (count - 1) * unit * magnitudes / count + unit * want.abs()
    assert ((mean - want).abs() <= bound).all(), ((mean - want).abs() / bound).max().item()


@pytest.mark.parametrize("staged", [False, True], ids=["paged", "staged"])
@pytest.mark.parametrize("dtype", FORMATS)
def test_compiles_once_across_changing_values(dtype: torch.dtype, staged: bool) -> None:
    compiled_state, eager_state = make_state(dtype), make_state(dtype)

    def block(tensors, pools, inputs):
        query, *rest = tensors
        return fused.write_attend(query * 1.5, *rest, pools, inputs).sum(dim=1)

    counter = CompileCounter()
    compiled = torch.compile(block, fullgraph=True, backend=counter)
    compiled_tags, eager_tags = torch.full((LAYERS,), -1), torch.full((LAYERS,), -1)
    for step in range(3):
        # The layer, block table, slots, history length and staging ids all change value; the
        # first call of each layer chooses its mean, inside the graph.
        tensors, inputs = forward(step, staged=staged, layer=step)
        inputs = inputs._replace(
            stage_key=torch.tensor(step), stage_from=torch.tensor(step if staged else -1)
        )
        got = compiled(tensors, compiled_state, inputs._replace(stage_tags=compiled_tags))
        want = block(tensors, eager_state, inputs._replace(stage_tags=eager_tags))
        assert torch.equal(got, want)
        assert equal(compiled_state, eager_state)
        assert torch.equal(compiled_tags, eager_tags)
    assert compiled_state.k_means_chosen.all()
    assert counter.frame_count == 1


def keys_major_state(state: fused.PoolTensors) -> fused.PoolTensors:
    """``state`` with the layout of ``PagingConfig(keys_major=True)``: the scale pools
    keys-major (copies, same values)."""

    def keys_major(stacked: torch.Tensor) -> torch.Tensor:
        return kernels.keys_major(stacked.flatten(0, 1)).unflatten(0, stacked.shape[:2])

    fields = {"k_scales": keys_major(state.k_scales), "v_scales": keys_major(state.v_scales)}
    return state._replace(**fields)


@pytest.mark.parametrize("staged", [False, True], ids=["paged", "staged"])
@pytest.mark.parametrize(
    "dtype, mode",
    [
        pytest.param(torch.int8, {}, id="int8"),
    ],
)
def test_keys_major_pools_write_and_attend_as_slot_major_ones(dtype, mode, staged) -> None:
    # Compiled (one graph for every step), over keys-major pools: the slot-major eager op's
    # outputs and stored values, bit for bit.
    slot_major = make_state(dtype)
    keys_major = keys_major_state(make_state(dtype))
    assert kernels.pool_layout.keys_aligned(keys_major.k_scales[0])
    counter = CompileCounter()
    compiled = torch.compile(fused.write_attend, fullgraph=True, backend=counter)
    tags = [torch.full((LAYERS,), -1) for _ in range(2)]
    for step in range(3):
        tensors, inputs = forward(step, staged=staged, layer=step, **mode)
        inputs = inputs._replace(
            stage_key=torch.tensor(step), stage_from=torch.tensor(step if staged else -1)
        )
        want = fused.write_attend(*tensors, slot_major, inputs._replace(stage_tags=tags[0]))
        got = compiled(*tensors, keys_major, inputs._replace(stage_tags=tags[1]))
        assert torch.equal(got, want)
    assert counter.frame_count == 1
    for name in ("k_pools", "v_pools", "k_scales", "v_scales", "k_means"):
        a, b = getattr(slot_major, name), getattr(keys_major, name)
        assert torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("staged", [False, True], ids=["paged", "staged"])
def test_the_first_write_chooses_the_factors_and_attention_folds_them(staged: bool) -> None:
    # The layer's first call chooses its factors (K's from the keys minus the mean it chose,
    # V's from the values: video rows only), writes video and action rows divided by them and
    # attends folding them back: the kernels called by hand with those factors agree bit for
    # bit. A later call of the layer keeps them. Another layer is untouched.
    state, twin = make_state(torch.int8, equalize=True), make_state(torch.int8, equalize=True)
    tensors, inputs = forward(0, staged=staged, layer=1)
    got = fused.write_attend(*tensors, state, inputs)
    assert state.equalizers_chosen.tolist() == [False, True, False]
    _, key, value, *_ = tensors
    mean = state.k_means[1]
    want_k = channel_factors(key.cpu(), smooth=mean.cpu(), share=K_SHARE)
    want_v = channel_factors(value.cpu())
    assert torch.equal(state.k_equalizers[1].cpu(), want_k)
    assert torch.equal(state.v_equalizers[1].cpu(), want_v)
    assert bool((want_v[:, [1, 6]] >= 16).all()) and bool((want_k[:, [2, 5]] >= 4).all())
    assert state.k_equalizers[0].isnan().all() and state.v_equalizers[2].isnan().all()
    factors = (state.k_equalizers[1], state.v_equalizers[1])
    assert torch.equal(got, direct_calls(tensors, inputs, twin, mean, factors))
    assert equal(
        state._replace(
            equalizers_chosen=twin.equalizers_chosen, k_means_chosen=twin.k_means_chosen
        ),
        twin._replace(
            k_means=state.k_means, k_equalizers=state.k_equalizers, v_equalizers=state.v_equalizers
        ),
    )
    chosen = [f.clone() for f in factors]
    tensors, inputs = forward(1, staged=staged, layer=1)
    tensors[2] = tensors[2] * 100.0
    fused.write_attend(*tensors, state, inputs)
    assert torch.equal(state.k_equalizers[1], chosen[0])
    assert torch.equal(state.v_equalizers[1], chosen[1])


@pytest.mark.parametrize("dtype", FORMATS)
def test_choice_slots_choose_from_every_video_row_and_write_only_video_slots(dtype) -> None:
    # One rank of a sharded window: video_slots writes some rows (-1 for the others'),
    # choice_slots are every row's. The layer freezes the mean and factors a call writing every
    # row freezes (bit for bit), and the rows with a slot hold that call's codes and scales;
    # the other rows' slots keep what they held.
    state, whole = make_state(dtype, equalize=True), make_state(dtype, equalize=True)
    tensors, inputs = forward(0, staged=False, layer=1)
    fused.write_attend(*tensors, whole, inputs)
    slots = inputs.video_slots
    mine = torch.where(torch.arange(slots.numel(), device=slots.device) % 3 == 0, slots, -1)
    fused.write_attend(*tensors, state, inputs._replace(video_slots=mine, choice_slots=slots))
    untouched = make_state(dtype, equalize=True)
    assert (whole.k_equalizers[1] > 1).any()
    written, skipped = mine[mine >= 0], slots[mine < 0]
    assert equal(
        state._replace(k_pools=None, v_pools=None, k_scales=None, v_scales=None),
        whole._replace(k_pools=None, v_pools=None, k_scales=None, v_scales=None),
    )
    for name in ("k_pools", "v_pools", "k_scales", "v_scales"):
        got, want = getattr(state, name)[1].flatten(0, 1), getattr(whole, name)[1].flatten(0, 1)
        kept = getattr(untouched, name)[1].flatten(0, 1)
        assert torch.equal(got[written].view(torch.uint8), want[written].view(torch.uint8))
        assert torch.equal(got[skipped].view(torch.uint8), kept[skipped].view(torch.uint8))


def test_smoothing_off_writes_plain_codes() -> None:
    state = make_state(torch.int8)
    empty = state.k_means.new_empty(0)
    state = state._replace(k_means=empty, k_means_chosen=empty.bool())
    tensors, inputs = forward(0, staged=False, layer=0)
    fused.write_attend(*tensors, state, inputs)
    slots = inputs.video_slots
    codes = state.k_pools[0].flatten(0, 1)[slots]
    scale = state.k_scales[0].flatten(0, 1)[slots]
    assert nearest_code_error(codes, scale, tensors[1], torch.int8).max() <= 1 + 1e-3


def replaced(field: str, make):
    return lambda pools, inputs: (pools._replace(**{field: make(getattr(pools, field))}), inputs)


def changed(**changes):
    return lambda pools, inputs: (pools, inputs._replace(**changes))


REFUSALS = [
    ("k-scales-dtype", replaced("k_scales", lambda t: t.double()), TypeError, "k_scales"),
    ("k-scales-shape", replaced("k_scales", lambda t: t[:, 1:]), ValueError, "k_scales"),
    ("v-scales-missing", replaced("v_scales", lambda t: t.new_empty(0)), ValueError, "v_scales"),
    ("v-pools-dtype", replaced("v_pools", lambda t: t.view(torch.uint8)), TypeError, "v_pools"),
    (  # the deleted e4m3 pool (issue 45): e4m3 codes with a scale per slot
        "e4m3-pools",
        lambda p, i: (
            p._replace(
                k_pools=p.k_pools.view(torch.float8_e4m3fn),
                v_pools=p.v_pools.view(torch.float8_e4m3fn),
            ),
            i,
        ),
        ValueError,
        'k_pools=torch.float8_e4m3fn .*deleted.*"k8v16".*"k8v8"',
    ),
    ("k-means-shape", replaced("k_means", lambda t: t[:, :, 1:]), ValueError, "k_means"),
    ("k-means-dtype", replaced("k_means", lambda t: t.double()), TypeError, "k_means"),
    (
        "k-means-chosen-dtype",
        replaced("k_means_chosen", lambda t: t.long()),
        TypeError,
        "k_means_chosen",
    ),
    (
        "k-means-chosen-shape",
        replaced("k_means_chosen", lambda t: t[1:]),
        ValueError,
        "k_means_chosen",
    ),
    (
        "chosen-without-means",
        replaced("k_means", lambda t: t.new_empty(0)),
        ValueError,
        "k_means_chosen",
    ),
    (
        "stage-scales-missing",
        lambda p, i: (
            p._replace(stage_k_scales=p.stage_k_scales.new_empty(0)),
            i._replace(stage_from=torch.tensor(0)),
        ),
        ValueError,
        "stage_k_scales",
    ),
    (
        "stage-float",
        lambda p, i: (
            p._replace(stage_v=p.stage_v.float()),
            i._replace(stage_from=torch.tensor(0)),
        ),
        TypeError,
        "stage_v",
    ),
    ("fp8-mma-deleted", changed(fp8_mma=True), ValueError, 'fp8_mma was deleted.*"k8v8"'),
    ("int8-mma-deleted", changed(int8_mma=True), ValueError, 'int8_mma was deleted.*"k8v16"'),
    ("return-lse-int", changed(return_lse=1), TypeError, "return_lse"),
    (
        "chosen-without-equalizers",
        replaced("equalizers_chosen", lambda t: torch.zeros(LAYERS, dtype=torch.bool)),
        ValueError,
        "equalizers_chosen must be zero-size",
    ),
    (
        "k-equalizers-shape",
        replaced("k_equalizers", lambda t: torch.ones(LAYERS, KV_HEADS, DIM + 1, device=DEVICE)),
        ValueError,
        "k_equalizers",
    ),
    (
        "v-equalizers-missing",
        replaced("k_equalizers", lambda t: torch.ones(LAYERS, KV_HEADS, DIM, device=DEVICE)),
        ValueError,
        "v_equalizers",
    ),
    (
        "equalizers-chosen-shape",
        lambda p, i: (
            p._replace(
                k_equalizers=torch.ones(LAYERS, KV_HEADS, DIM, device=DEVICE),
                v_equalizers=torch.ones(LAYERS, KV_HEADS, DIM, device=DEVICE),
                equalizers_chosen=torch.zeros(LAYERS + 1, dtype=torch.bool),
            ),
            i,
        ),
        ValueError,
        "equalizers_chosen",
    ),
    (
        "action-rows",
        changed(action_slots=torch.zeros(2, dtype=torch.int64)),
        ValueError,
        "action_key",
    ),
    ("stage-from", changed(stage_from=torch.tensor(WIDTH + 1)), ValueError, "stage_from"),
    (
        "choice-slots-shape",
        changed(choice_slots=torch.zeros(1, dtype=torch.int64, device=DEVICE)),
        ValueError,
        "choice_slots must have video_slots' shape",
    ),
    (
        "choice-slots-dtype",
        lambda p, i: (p, i._replace(choice_slots=i.video_slots.float())),
        TypeError,
        "choice_slots",
    ),
]


@pytest.mark.parametrize("change, error, match", [pytest.param(*r[1:], id=r[0]) for r in REFUSALS])
@pytest.mark.parametrize("dtype", FORMATS)
def test_refused_call_changes_nothing(dtype: torch.dtype, change, error, match: str) -> None:
    state = make_state(dtype)
    before = clone(state)
    tensors, inputs = forward(0, staged=False, layer=1)
    pools, inputs = change(state, inputs)
    with pytest.raises(error, match=match):
        fused.write_attend(*tensors, pools, inputs)
    assert equal(state, before)


def test_float_pools_refuse_scales() -> None:
    state = make_state(torch.int8)
    pools = fused.PoolTensors.build(
        state.k_pools.float(), state.v_pools.float(), state.stage_k.float(), state.stage_v.float()
    )
    tensors, inputs = forward(0, staged=False, layer=1)
    before = clone(pools)
    with pytest.raises(ValueError, match=r"k_scales must be zero-size for torch\.float32 pools"):
        fused.write_attend(*tensors, pools._replace(k_scales=state.k_scales), inputs)
    assert equal(pools, before)
    with pytest.raises(TypeError, match="unknown pool tensors"):
        fused.PoolTensors.build(*pools[:4], scales=state.k_scales)
