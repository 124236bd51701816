"""Bad input to each public kernel function: a clear ValueError/TypeError naming the argument,
raised before anything is written."""

from __future__ import annotations

import pytest
import torch

from paged_video import kernels
from tests.kernels.paged_case import make_paged_case


def attention_args(**overrides):
    case = make_paged_case(q_lens=[4, 6], k_lens=[9, 20], block_size=8)
    args = {
        "q": case.q,
        "k_cache": case.k_cache,
        "v_cache": case.v_cache,
        "block_table": case.block_table,
        "cu_seqlens_q": case.cu_seqlens_q,
        "seq_lens_k": case.seq_lens_k,
        "max_seqlen_q": case.max_seqlen_q,
    }
    args.update(overrides)
    return args


def call_attention(args):
    positional = [
        args.pop(name)
        for name in ("q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "seq_lens_k")
    ]
    return kernels.paged_attention(*positional, **args)


ATTENTION_CASES = [
    pytest.param(lambda a: {"q": a["q"][0]}, ValueError, "q", id="q-rank"),
    pytest.param(lambda a: {"k_cache": a["k_cache"][0]}, ValueError, "k_cache", id="k-rank"),
    pytest.param(lambda a: {"q": a["q"].double()}, TypeError, "q", id="q-dtype"),
    pytest.param(lambda a: {"v_cache": a["v_cache"].half()}, TypeError, "v_cache", id="v-dtype"),
    pytest.param(lambda a: {"q": a["q"][:, :3]}, ValueError, "num_heads", id="heads-not-multiple"),
    pytest.param(
        lambda a: {"q": a["q"][:, :, :32]}, ValueError, "head_dim", id="head-dim-mismatch"
    ),
    pytest.param(
        lambda a: {
            "q": torch.zeros(10, 4, 320),
            "k_cache": torch.zeros(4, 8, 2, 320),
            "v_cache": torch.zeros(4, 8, 2, 320),
        },
        ValueError,
        "head_dim",
        id="head-dim-unsupported",
    ),
    pytest.param(
        lambda a: {"block_table": a["block_table"].long()},
        TypeError,
        "block_table",
        id="table-int64",
    ),
    pytest.param(
        lambda a: {"seq_lens_k": a["seq_lens_k"].long()}, TypeError, "seq_lens_k", id="lens-int64"
    ),
    pytest.param(
        lambda a: {"block_table": a["block_table"][:, :2]},
        ValueError,
        "block_table",
        id="table-too-narrow",
    ),
    pytest.param(
        lambda a: {"seq_lens_k": torch.tensor([9, -1], dtype=torch.int32)},
        ValueError,
        "seq_lens_k",
        id="negative-length",
    ),
    pytest.param(
        lambda a: {"cu_seqlens_q": torch.tensor([0, 4], dtype=torch.int32)},
        ValueError,
        "cu_seqlens_q",
        id="cu-seqlens-shape",
    ),
    pytest.param(
        lambda a: {"cu_seqlens_q": torch.tensor([0, 4], dtype=torch.int32), "check_values": False},
        ValueError,
        r"cu_seqlens_q must have shape \(3,\)",
        id="cu-seqlens-shape-unchecked-values",
    ),
    pytest.param(
        lambda a: {"cu_seqlens_q": torch.tensor([0, 7, 10], dtype=torch.int32)},
        ValueError,
        "max_seqlen_q",
        id="max-seqlen-too-small",
    ),
    pytest.param(
        lambda a: {"block_table": torch.full_like(a["block_table"], 99)},
        ValueError,
        "block_table",
        id="table-out-of-range",
    ),
    pytest.param(
        lambda a: {"k_cache": a["k_cache"].to("meta")}, ValueError, "device", id="mixed-devices"
    ),
    pytest.param(lambda a: {"out": a["q"][:2]}, ValueError, "out", id="out-shape"),
    pytest.param(
        lambda a: {"key_limits": torch.zeros(3, dtype=torch.int32)},
        ValueError,
        "key_limits",
        id="key-limits-shape",
    ),
    pytest.param(
        lambda a: {"key_gap": torch.zeros(2, 2)}, TypeError, "key_gap", id="key-gap-dtype"
    ),
    pytest.param(lambda a: {"block_n": 24}, ValueError, "block_n", id="tile-not-pow2"),
    pytest.param(lambda a: {"max_seqlen_q": 2.0}, TypeError, "max_seqlen_q", id="max-seqlen-type"),
    pytest.param(lambda a: {"q": a["q"].numpy()}, TypeError, "q", id="q-not-tensor"),
    pytest.param(
        lambda a: {"softmax_scale": "0.1"},
        TypeError,
        "softmax_scale must be a float or None, got str",
        id="softmax-scale-str",
    ),
    pytest.param(
        lambda a: {"softmax_scale": float("nan")},
        ValueError,
        "softmax_scale must be finite",
        id="softmax-scale-nan",
    ),
    pytest.param(lambda a: {"causal": 1}, TypeError, "causal must be a bool", id="causal-int"),
    pytest.param(
        lambda a: {"return_lse": "yes"},
        TypeError,
        "return_lse must be a bool",
        id="return-lse-str",
    ),
]


@pytest.mark.parametrize("override, error, word", ATTENTION_CASES)
def test_paged_attention_rejects(override, error, word) -> None:
    args = attention_args()
    sentinel = torch.full_like(args["q"], 7.0)
    args["out"] = sentinel
    args.update(override(args))
    with pytest.raises(error, match=word):
        call_attention(args)
    assert torch.equal(sentinel, torch.full_like(sentinel, 7.0)), "a rejected call wrote out"


def write_args():
    k_pool = torch.zeros(32, 2, 16)
    v_pool = torch.zeros(32, 2, 16)
    key = torch.ones(4, 2, 16)
    value = torch.ones(4, 2, 16)
    slots = torch.tensor([0, 5, 9, 31])
    return [key, value, k_pool, v_pool, slots]


WRITE_CASES = [
    pytest.param(0, lambda t: t[0], ValueError, "key", id="key-rank"),
    pytest.param(1, lambda t: t[:, :1], ValueError, "value", id="value-shape"),
    pytest.param(2, lambda t: t[:, :1], ValueError, "k_pool", id="pool-heads"),
    pytest.param(4, lambda t: t.float(), TypeError, "slot_mapping", id="slots-float"),
    pytest.param(4, lambda t: torch.arange(6), ValueError, "slot_mapping", id="slots-too-many"),
    pytest.param(
        4, lambda t: torch.tensor([0, 32]), ValueError, "slot_mapping", id="slot-past-pool"
    ),
    pytest.param(4, lambda t: torch.tensor([3, 3]), ValueError, "slot_mapping", id="slot-twice"),
    pytest.param(0, lambda t: t.to("meta"), ValueError, "device", id="mixed-devices"),
    pytest.param(0, lambda t: t.double(), TypeError, "key", id="key-dtype"),
    pytest.param(2, lambda t: t[None], ValueError, "k_pool", id="pool-rank-5"),
    pytest.param(2, lambda t: t.view(4, 8, 2, 16), ValueError, "v_pool", id="paged-and-flat"),
]


@pytest.mark.parametrize("keys_major", [False, True], ids=["slot-major", "keys-major"])
def test_write_slots_rejects_a_slot_past_paged_pools(keys_major: bool) -> None:
    key, value, k_pool, v_pool, _ = write_args()
    k_pool, v_pool = (t.view(4, 8, 2, 16) for t in (k_pool, v_pool))
    if keys_major:
        k_pool, v_pool = kernels.keys_major(k_pool), kernels.keys_major(v_pool)
    with pytest.raises(ValueError, match="slot_mapping holds slot 32 past the pool's 32 slots"):
        kernels.write_slots(key, value, k_pool, v_pool, torch.tensor([0, 32]))
    assert not k_pool.any() and not v_pool.any()


@pytest.mark.parametrize("index, change, error, word", WRITE_CASES)
def test_write_slots_rejects_and_changes_nothing(index, change, error, word) -> None:
    args = write_args()
    args[index] = change(args[index])
    k_before, v_before = args[2].clone(), args[3].clone()
    with pytest.raises(error, match=word):
        kernels.write_slots(*args)
    if args[2].device.type != "meta":
        assert torch.equal(args[2], k_before) and torch.equal(args[3], v_before)


def test_write_slots_rejects_one_tensor_for_both_pools() -> None:
    key, value, k_pool, _, slots = write_args()
    with pytest.raises(ValueError, match="v_pool"):
        kernels.write_slots(key, value, k_pool, k_pool, slots)


def gather_args():
    k_cache = torch.zeros(5, 8, 2, 16)
    v_cache = torch.zeros(5, 8, 2, 16)
    ids = torch.tensor([1, 2, 3], dtype=torch.int32)
    stage_k = torch.full((24, 2, 16), 3.0)
    stage_v = torch.full((24, 2, 16), 3.0)
    return [k_cache, v_cache, ids, stage_k, stage_v]


GATHER_CASES = [
    pytest.param(0, lambda t: t[0], {}, ValueError, "k_cache", id="cache-rank"),
    pytest.param(2, lambda t: t.float(), {}, TypeError, "block_ids", id="ids-float"),
    pytest.param(2, lambda t: torch.tensor([1, 9]), {}, ValueError, "block_ids", id="id-range"),
    pytest.param(3, lambda t: t[:16], {}, ValueError, "stage_k", id="stage-too-short"),
    pytest.param(4, lambda t: t[:, :1], {}, ValueError, "stage_v", id="stage-shape"),
    pytest.param(3, lambda t: t[:, :, :8], {}, ValueError, "stage_k", id="stage-head-dim"),
    pytest.param(2, lambda t: t, {"first_block": 4}, ValueError, "first_block", id="first-range"),
    pytest.param(2, lambda t: t, {"first_block": 1.0}, TypeError, "first_block", id="first-type"),
    pytest.param(1, lambda t: t.to("meta"), {}, ValueError, "device", id="mixed-devices"),
]


@pytest.mark.parametrize("index, change, kwargs, error, word", GATHER_CASES)
def test_gather_blocks_rejects_and_changes_nothing(index, change, kwargs, error, word) -> None:
    args = gather_args()
    args[index] = change(args[index])
    with pytest.raises(error, match=word):
        kernels.gather_blocks(*args, **kwargs)
    for stage in args[3:]:
        if stage.device.type != "meta":
            assert torch.equal(stage, torch.full_like(stage, 3.0))


def test_gather_blocks_needs_a_row_for_every_slot() -> None:
    args = gather_args()
    args[3], args[4] = args[3][:23], args[4][:23]  # 3 blocks of 8 slots: one row short
    with pytest.raises(ValueError, match="stage_k has 23 rows"):
        kernels.gather_blocks(*args)
    assert (args[3] == 3.0).all()


def quantized_write_args(dtype=torch.int8):
    key, value, _, _, slots = write_args()
    pools = [torch.zeros(32, 2, 16, dtype=dtype) for _ in range(2)]
    scales = {"k_scale": torch.full((32, 2), 5.0), "v_scale": torch.full((32, 2), 5.0)}
    return [key, value, *pools, slots], scales


QUANTIZED_WRITE_CASES = [
    pytest.param(lambda a, k: k.pop("k_scale"), ValueError, "k_scale", id="missing-k-scale"),
    pytest.param(lambda a, k: k.pop("v_scale"), ValueError, "v_scale", id="missing-v-scale"),
    pytest.param(
        lambda a, k: k.update(k_scale=k["k_scale"].double()), TypeError, "k_scale", id="scale-dtype"
    ),
    pytest.param(
        lambda a, k: k.update(v_scale=k["v_scale"][:, :1]), ValueError, "v_scale", id="scale-shape"
    ),
    pytest.param(
        lambda a, k: k.update(v_scale=k["k_scale"]), ValueError, "v_scale", id="scale-shared"
    ),
    pytest.param(
        lambda a, k: a.__setitem__(3, torch.zeros(32, 2, 16)),
        TypeError,
        "v_pool",
        id="mixed-pools",
    ),
    pytest.param(  # the deleted e4m3 pool (issue 45)
        lambda a, k: a.__setitem__(2, a[2].to(torch.float8_e4m3fn)),
        ValueError,
        'k_pool=torch.float8_e4m3fn .*deleted.*"k8v16"',
        id="e4m3-pool",
    ),
    pytest.param(
        lambda a, k: k.update(k_smooth=torch.zeros(2, 8)), ValueError, "k_smooth", id="smooth-shape"
    ),
    pytest.param(
        lambda a, k: k.update(k_smooth=torch.zeros(2, 16).half()),
        TypeError,
        "k_smooth",
        id="smooth-dtype",
    ),
    pytest.param(
        lambda a, k: k.update(k_equalizer=torch.ones(2, 8)),
        ValueError,
        "k_equalizer",
        id="equalizer-shape",
    ),
    pytest.param(
        lambda a, k: k.update(v_equalizer=torch.ones(2, 16).double()),
        TypeError,
        "v_equalizer",
        id="equalizer-dtype",
    ),
    pytest.param(
        lambda a, k: k.update(v_equalizer=torch.tensor([[1.0] * 15 + [0.0]] * 2)),
        ValueError,
        "v_equalizer must be finite and > 0",
        id="equalizer-zero",
    ),
    pytest.param(
        lambda a, k: k.update(k_equalizer=torch.full((2, 16), float("inf"))),
        ValueError,
        "k_equalizer must be finite and > 0",
        id="equalizer-inf",
    ),
    pytest.param(
        lambda a, k: k.update(k_smooth_chosen=torch.tensor(False)),
        ValueError,
        "k_smooth_chosen needs k_smooth",
        id="chosen-without-mean",
    ),
    pytest.param(
        lambda a, k: k.update(k_smooth=torch.zeros(2, 16), k_smooth_chosen=torch.tensor(0)),
        TypeError,
        "k_smooth_chosen",
        id="chosen-dtype",
    ),
    pytest.param(
        lambda a, k: k.update(
            k_smooth=torch.zeros(2, 16), k_smooth_chosen=torch.zeros(1, dtype=torch.bool)
        ),
        ValueError,
        "k_smooth_chosen must be a 0-dim",
        id="chosen-shape",
    ),
]


@pytest.mark.parametrize("change, error, word", QUANTIZED_WRITE_CASES)
def test_quantized_write_slots_rejects_and_changes_nothing(change, error, word) -> None:
    args, kwargs = quantized_write_args()
    change(args, kwargs)
    before = [t.clone() for t in (*args[2:4], *kwargs.values())]
    with pytest.raises(error, match=word):
        kernels.write_slots(*args, **kwargs)
    for now, then in zip((*args[2:4], *kwargs.values()), before, strict=True):
        assert torch.equal(now.float(), then.float()), "a rejected call wrote a pool or scale"


def test_write_slots_rejects_scales_and_smoothing_for_float_pools() -> None:
    args = write_args()
    with pytest.raises(ValueError, match="k_scale"):
        kernels.write_slots(*args, k_scale=torch.zeros(32, 2))
    with pytest.raises(ValueError, match="k_smooth"):
        kernels.write_slots(*args, k_smooth=torch.zeros(2, 16))
    for name in ("k_equalizer", "v_equalizer"):
        with pytest.raises(ValueError, match=f"{name} is only for quantized pools"):
            kernels.write_slots(*args, **{name: torch.ones(2, 16)})
    assert torch.equal(args[2], torch.zeros_like(args[2]))


def quantized_gather_args(dtype=torch.int8):
    caches = [torch.zeros(5, 8, 2, 16, dtype=dtype) for _ in range(2)]
    ids = torch.tensor([1, 2, 3], dtype=torch.int32)
    stages = [torch.full((24, 2, 16), 3.0).to(dtype) for _ in range(2)]
    kwargs = {
        "k_scale": torch.zeros(5, 8, 2),
        "v_scale": torch.zeros(5, 8, 2),
        "stage_k_scale": torch.full((24, 2), 3.0),
        "stage_v_scale": torch.full((24, 2), 3.0),
    }
    return [*caches, ids, *stages], kwargs


QUANTIZED_GATHER_CASES = [
    pytest.param(lambda a, k: k.pop("v_scale"), ValueError, "v_scale", id="missing-v-scale"),
    pytest.param(
        lambda a, k: k.pop("stage_k_scale"), ValueError, "stage_k_scale", id="missing-stage-scale"
    ),
    pytest.param(
        lambda a, k: k.update(k_scale=k["k_scale"].half()), TypeError, "k_scale", id="scale-dtype"
    ),
    pytest.param(
        lambda a, k: k.update(stage_v_scale=k["stage_v_scale"][:20]),
        ValueError,
        "stage_v_scale",
        id="stage-scale-shape",
    ),
    pytest.param(
        lambda a, k: a.__setitem__(3, torch.full((24, 2, 16), 3.0)),
        TypeError,
        "stage_k",
        id="stage-float",
    ),
    pytest.param(
        lambda a, k: a.__setitem__(1, torch.zeros(5, 8, 2, 16)),
        TypeError,
        "v_cache",
        id="mixed-caches",
    ),
    pytest.param(  # the deleted e4m3 pool (issue 45)
        lambda a, k: a.__setitem__(0, a[0].to(torch.float8_e4m3fn)),
        ValueError,
        'k_cache=torch.float8_e4m3fn .*deleted.*"k8v8"',
        id="e4m3-pool",
    ),
]


@pytest.mark.parametrize("change, error, word", QUANTIZED_GATHER_CASES)
def test_quantized_gather_blocks_rejects_and_changes_nothing(change, error, word) -> None:
    args, kwargs = quantized_gather_args()
    change(args, kwargs)
    with pytest.raises(error, match=word):
        kernels.gather_blocks(*args, **kwargs)
    for stage in (*args[3:], kwargs.get("stage_k_scale"), kwargs.get("stage_v_scale")):
        if stage is not None:
            assert torch.equal(stage.float(), torch.full(stage.shape, 3.0))
