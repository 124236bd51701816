"""kernels.merge_attention_states / merge_stacked_attention_states.

Attention over a key set split into disjoint parts (each attended with ``return_lse=True``)
merges into the float64 oracle's attention over all the keys; arbitrary partials (strided,
with empty parts whose outputs hold NaN) merge as the float64 merge oracle does.
"""

from __future__ import annotations

import pytest
import torch

from paged_video import kernels, reference
from paged_video.kernels import _runtime
from tests.helpers import DEVICE, ON_GPU, nan_like
from tests.kernels.paged_case import assert_lse_close, make_paged_case
from tests.kernels.test_paged_attention_quantized import quantized_args

FP32_ATOL = 2e-5
LSE_RTOL = 2e-6


def oracle(args: tuple, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 oracle's ``(out, lse)`` of attention over all keys, both float64."""
    out = torch.empty(args[0].shape, dtype=torch.float64, device=DEVICE)
    return reference.paged_attention(*args, out=out, return_lse=True, **kwargs)


def owned_gaps(k_lens: list[int], part: int, parts: int, frame: int) -> torch.Tensor:
    """``key_gap`` hiding every key but part ``part``'s: keys are dealt out round-robin in
    frames of ``frame`` keys (frame f belongs to part f % parts). ``(batch, gaps, 2)``."""
    rows = []
    for k_len in k_lens:
        hidden, lo = [], 0
        for start in range(0, k_len, frame):
            if (start // frame) % parts == part:
                hidden.append((lo, start))
                lo = start + frame
        hidden.append((lo, max(k_len, lo)))
        rows.append(hidden)
    width = max(len(r) for r in rows)
    padded = [r + [(0, 0)] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.int32, device=DEVICE)


def attend_parts(args: tuple, parts: int, frame: int, **kwargs) -> tuple[list, list]:
    """Each part's ``(out, lse)``; outputs of rows a part saw nothing of are set to NaN (the
    merge must not read them)."""
    outs, lses = [], []
    k_lens = args[5].tolist()
    for part in range(parts):
        out, lse = kernels.paged_attention(
            *args,
            key_gap=owned_gaps(k_lens, part, parts, frame),
            out=nan_like(args[0]),
            return_lse=True,
            **kwargs,
        )
        assert not torch.isnan(out).any()
        out[torch.isneginf(lse)] = float("nan")
        outs.append(out)
        lses.append(lse)
    return outs, lses


def merged_outputs(outs: list, lses: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The merge three ways, into NaN-filled outputs: stacked, pairwise chained, and (for more
    than two parts) the stack of all but the last merged pairwise with the last."""
    q = outs[0]

    def targets():
        return {"out": nan_like(q), "out_lse": torch.full(q.shape[:2], float("nan"), device=DEVICE)}

    results = [
        kernels.merge_stacked_attention_states(torch.stack(outs), torch.stack(lses), **targets())
    ]
    out, lse = outs[0], lses[0]
    for part_out, part_lse in zip(outs[1:], lses[1:], strict=True):
        out, lse = kernels.merge_attention_states(out, lse, part_out, part_lse, **targets())
    results.append((out, lse))
    if len(outs) > 2:
        head = kernels.merge_stacked_attention_states(
            torch.stack(outs[:-1]), torch.stack(lses[:-1])
        )
        results.append(kernels.merge_attention_states(*head, outs[-1], lses[-1], **targets()))
    return results


# (block_size, parts, frame, q_lens, k_lens): chunks whose queries are the last keys of a
# sequence that ends mid-block; frames that do not align with blocks; a part that owns no key of
# a short sequence; a sequence with no keys.
SPLITS = [
    pytest.param(7, 2, 20, [9, 4], [45, 11], id="B7-2parts"),
    pytest.param(24, 3, 10, [12, 5, 3], [83, 17, 0], id="B24-3parts"),
    pytest.param(1, 4, 5, [6, 3], [38, 9], id="B1-4parts"),
    pytest.param(1560, 2, 1600, [5], [1700], id="B1560-2parts"),
]


@pytest.mark.parametrize("block_size, parts, frame, q_lens, k_lens", SPLITS)
def test_split_keys_merge_to_attention_over_all(block_size, parts, frame, q_lens, k_lens) -> None:
    # GQA 6/2, head_dim 80, causal, a permuted table, per-row limits with a row limited to 0
    # keys (every part empty: zeros and -inf after the merge).
    case = make_paged_case(
        q_lens=q_lens,
        k_lens=k_lens,
        block_size=block_size,
        num_heads=6,
        num_kv_heads=2,
        head_dim=80,
        device=DEVICE,
    )
    total_q = sum(q_lens)
    key_limits = torch.tensor([0] + [10**6] * (total_q - 1), dtype=torch.int32, device=DEVICE)
    kwargs = dict(max_seqlen_q=case.max_seqlen_q, causal=True, key_limits=key_limits)
    want, want_lse = oracle(case.args(), **kwargs)
    outs, lses = attend_parts(case.args(), parts, frame, **kwargs)
    for out, lse in merged_outputs(outs, lses):
        assert not torch.isnan(out).any() and out.dtype == case.q.dtype
        torch.testing.assert_close(out.double(), want, atol=FP32_ATOL, rtol=0)
        assert_lse_close(lse, want_lse, LSE_RTOL)
    assert torch.isneginf(lse[0]).all() and not out[0].any()


def test_merge_of_shards_in_separate_tables_fp16() -> None:
    # Blocks dealt round-robin to two shards (as a sequence-sharded window holds them): each
    # shard attends its blocks as one sequence through its own table. fp16 parts merge to fp16.
    case = make_paged_case(
        q_lens=[7, 3], k_lens=[40, 12], block_size=7, dtype=torch.float16, device=DEVICE
    )
    args = case.args()
    want, want_lse = oracle(args, max_seqlen_q=7)
    outs, lses = [], []
    for shard in range(2):
        table = case.block_table[:, shard::2].contiguous()
        lens = []
        for k_len in case.seq_lens_k.tolist():
            blocks = range(shard, -(-k_len // 7), 2)
            lens.append(sum(min(7, k_len - 7 * b) for b in blocks))
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        shard_args = (case.q, case.k_cache, case.v_cache, table, case.cu_seqlens_q, seq_lens)
        out, lse = kernels.paged_attention(*shard_args, max_seqlen_q=7, return_lse=True)
        outs.append(out)
        lses.append(lse)
    out, lse = kernels.merge_attention_states(outs[0], lses[0], outs[1], lses[1])
    assert out.dtype == torch.float16
    # fp16 parts and output: three roundings of values below 4 (2**-11 relative each).
    torch.testing.assert_close(out.double(), want, atol=3e-3, rtol=0)
    assert_lse_close(lse, want_lse, 1e-5)


def test_merge_of_quantized_parts() -> None:
    # int8 pools: the parts' LSEs are of the dequantized keys, so they merge to the
    # dequantizing oracle over all keys.
    case = make_paged_case(q_lens=[6, 9], k_lens=[50, 30], block_size=24, device=DEVICE)
    args, scales = quantized_args(case, torch.int8)
    max_seqlen_q = scales.pop("max_seqlen_q")
    want, want_lse = oracle(args, **scales, max_seqlen_q=max_seqlen_q, causal=True)
    outs, lses = attend_parts(args, 2, 16, max_seqlen_q=max_seqlen_q, causal=True, **scales)
    out, lse = kernels.merge_attention_states(outs[0], lses[0], outs[1], lses[1])
    limit = FP32_ATOL * max(1.0, want.abs().max().item())
    assert (out.double() - want).abs().max().item() <= limit
    assert_lse_close(lse, want_lse, LSE_RTOL)


def random_parts(parts: int, shape: tuple[int, int, int], dtype: torch.dtype, seed: int = 0):
    """Strided ``(n, T, H, D)`` outputs and ``(n, T, H)`` LSEs (every other head of wider
    tensors; the LSEs stored part-last). About a third of the LSEs are -inf, their outputs NaN;
    token 1 is empty in every part; tokens 2 and 3 have LSEs of magnitude ~300."""
    gen = torch.Generator().manual_seed(seed)
    tokens, heads, dim = shape
    wide = torch.randn(parts, tokens, 2 * heads, dim + 3, generator=gen).to(dtype)
    outs = wide[:, :, ::2, 3:]
    lses = (torch.randn(tokens, 2 * heads, parts, generator=gen) * 4)[:, ::2].permute(2, 0, 1)
    # Token 2's LSEs near +300 and token 3's near -300: exp() of them over- or underflows
    # float32, so only weights relative to the row max are right.
    lses[:, 2] += 300.0
    lses[:, 3] -= 300.0
    empty = torch.rand(parts, tokens, heads, generator=gen) < 0.35
    empty[:, 1] = True
    lses[empty] = float("-inf")
    outs[empty] = float("nan")
    assert not lses.is_contiguous() and (dim == 0 or not outs.is_contiguous())
    return outs.to(DEVICE), lses.to(DEVICE)


DTYPES = [
    pytest.param(torch.float32, 80, id="fp32-D80"),
    pytest.param(torch.float16, 300, id="fp16-D300"),
    pytest.param(
        torch.bfloat16,
        128,
        id="bf16-D128",
        marks=pytest.mark.skipif(not ON_GPU, reason="the interpreter computes bf16 wrongly"),
    ),
]


def check_against_oracle(got: tuple, outs: torch.Tensor, lses: torch.Tensor) -> None:
    want, want_lse = reference.merge_attention_states(outs, lses)
    out, lse = got
    assert out.dtype == outs.dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any()
    # The float32 result rounded to the parts' dtype.
    atol = 1e-6 if outs.dtype == torch.float32 else 4 * torch.finfo(outs.dtype).eps
    torch.testing.assert_close(out.double(), want, atol=atol, rtol=0)
    assert_lse_close(lse, want_lse, LSE_RTOL)
    assert torch.isneginf(lse[1]).all() and not out[1].any()


@pytest.mark.parametrize("dtype, dim", DTYPES)
def test_strided_parts_with_empty_ones(dtype: torch.dtype, dim: int) -> None:
    # head_dim 300 spans two programs along the dimension (only the first stores the LSE).
    outs, lses = random_parts(3, (37, 5, dim), dtype)
    check_against_oracle(kernels.merge_stacked_attention_states(outs, lses), outs, lses)
    two = kernels.merge_attention_states(outs[0], lses[0], outs[2], lses[2])
    check_against_oracle(two, outs[0::2], lses[0::2])


def test_one_part_and_no_parts() -> None:
    # One part merges to itself (weight exp(0) = 1), an empty row to zeros; no parts at all is
    # attention over no key.
    outs, lses = random_parts(1, (9, 3, 16), torch.float32)
    out, lse = kernels.merge_stacked_attention_states(outs, lses, out=nan_like(outs[0]))
    seen = torch.isfinite(lses[0])
    assert torch.equal(out[seen], outs[0][seen]) and torch.equal(lse, lses[0])
    assert not out[~seen].any()
    out, lse = kernels.merge_stacked_attention_states(outs[:0], lses[:0], out=nan_like(outs[0]))
    assert not out.any() and torch.isneginf(lse).all()


def test_head_dim_zero_still_merges_the_lses() -> None:
    outs, lses = random_parts(2, (5, 3, 0), torch.float32)
    out, lse = kernels.merge_stacked_attention_states(outs, lses)
    assert out.shape == (5, 3, 0)
    assert_lse_close(lse, torch.logsumexp(lses.double(), dim=0), LSE_RTOL)


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.setattr(_runtime, "interpreter_active", lambda: False)
    assert _runtime.use_torch_path(torch.zeros(1))


def test_torch_path(no_interpreter) -> None:
    outs, lses = random_parts(3, (21, 4, 24), torch.float32, seed=1)
    check_against_oracle(kernels.merge_stacked_attention_states(outs, lses), outs, lses)
    two = kernels.merge_attention_states(outs[0], lses[0], outs[1], lses[1])
    check_against_oracle(two, outs[:2], lses[:2])
    out, lse = kernels.merge_stacked_attention_states(outs[:0], lses[:0])
    assert not out.any() and torch.isneginf(lse).all()


def _two_way_args():
    outs, lses = random_parts(2, (6, 2, 16), torch.float32)
    return {"out_a": outs[0], "lse_a": lses[0], "out_b": outs[1], "lse_b": lses[1]}


BAD_TWO_WAY = [
    pytest.param({"out_a": lambda a: a["out_a"][0]}, ValueError, "out_a", id="out-a-rank"),
    pytest.param({"lse_b": lambda a: a["lse_b"].double()}, TypeError, "lse_b", id="lse-b-dtype"),
    pytest.param({"lse_a": lambda a: a["lse_a"][:5]}, ValueError, "lse_a", id="lse-a-shape"),
    pytest.param({"out_b": lambda a: a["out_b"].half()}, ValueError, "out_b", id="out-b-dtype"),
    pytest.param({"out_b": lambda a: a["out_b"][:5]}, ValueError, "out_b", id="out-b-shape"),
    pytest.param({"out_a": lambda a: a["out_a"].int()}, TypeError, "out_a", id="out-a-int"),
    pytest.param({"lse_a": lambda a: a["lse_a"].tolist()}, TypeError, "lse_a", id="lse-a-list"),
    pytest.param({"out": lambda a: a["out_a"][:, :1]}, ValueError, "out", id="out-shape"),
    pytest.param({"out": lambda a: [0.0]}, TypeError, "out", id="out-list"),
    pytest.param(
        {"out_lse": lambda a: torch.empty(6, 2, dtype=torch.float64)},
        ValueError,
        "out_lse",
        id="out-lse-dtype",
    ),
    pytest.param({"out": lambda a: a["out_a"]}, ValueError, "out must not share", id="out-is-a"),
    pytest.param(
        {"out": lambda a: a["out_b"][:, :1].expand(6, 2, 16)},
        ValueError,
        "out must not share",
        id="out-views-b",
    ),
    pytest.param(
        {"out_lse": lambda a: a["lse_a"]}, ValueError, "out_lse must not share", id="lse-alias"
    ),
    pytest.param(
        {"lse_b": lambda a: a["lse_b"].to("meta")}, ValueError, "device", id="mixed-devices"
    ),
]


@pytest.mark.parametrize("change, error, word", BAD_TWO_WAY)
def test_two_way_rejects(change, error, word) -> None:
    args = _two_way_args()
    args["out"] = torch.full((6, 2, 16), 7.0, device=DEVICE)
    args["out_lse"] = torch.full((6, 2), 7.0, device=DEVICE)
    args.update({name: make(args) for name, make in change.items()})
    sentinels = {name: args[name] for name in ("out", "out_lse") if name not in change}
    with pytest.raises(error, match=word):
        kernels.merge_attention_states(**args)
    for tensor in sentinels.values():
        assert (tensor == 7.0).all(), "a rejected call wrote its output"


@pytest.mark.parametrize(
    "change, error, word",
    [
        pytest.param(lambda o, s: (o[0], s), ValueError, "outs", id="outs-rank"),
        pytest.param(lambda o, s: (o, s[:, :-1]), ValueError, "lses", id="lses-shape"),
        pytest.param(lambda o, s: (o, s.half()), TypeError, "lses", id="lses-dtype"),
        pytest.param(lambda o, s: (o.long(), s), TypeError, "outs", id="outs-dtype"),
    ],
)
def test_stacked_rejects(change, error, word) -> None:
    outs, lses = change(*random_parts(2, (6, 2, 16), torch.float32))
    with pytest.raises(error, match=word):
        kernels.merge_stacked_attention_states(outs, lses)


def test_owned_gaps_deal_every_key_to_one_part() -> None:
    # The split this file relies on: every key is visible to exactly one part.
    assert owned_gaps([23], 1, 3, 5).tolist() == [[[0, 5], [10, 20], [25, 25]]]
    k_lens = [23, 4, 0]
    for parts, frame in ((2, 20), (3, 5), (4, 1)):
        owners = torch.zeros(len(k_lens), 23, dtype=torch.int64)
        for part in range(parts):
            gaps = owned_gaps(k_lens, part, parts, frame).cpu()
            keys = torch.arange(23)
            hidden = ((keys >= gaps[..., :1]) & (keys < gaps[..., 1:])).any(dim=1)
            owners += ~hidden
        for row, k_len in enumerate(k_lens):
            assert (owners[row, :k_len] == 1).all()
