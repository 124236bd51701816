"""Index tensors as strided views (docs/kernels.md): every index argument of every launcher,
given as a column of a 2-D tensor whose other column holds wrong but plausible values, must
give the oracle's result. A launcher that read ``ptr + i`` would read those values instead.
Also pinned: a non-contiguous ``block_table`` and a ``value`` laid out unlike ``key``.
"""

from __future__ import annotations

import pytest
import torch

from paged_video import kernels, reference
from paged_video.kernels import fused
from paged_video.kernels.masks import key_limits_from_spans, mixed_mask_attention
from paged_video.kernels.paged_attention import kv_path
from tests.helpers import DEVICE, nan_like
from tests.kernels.paged_case import make_paged_case
from tests.kernels.test_fused import direct_calls, make_forward, make_state

FP32_ATOL = 2e-5


def column(tensor: torch.Tensor, junk: int) -> torch.Tensor:
    """``tensor``'s values as a non-contiguous view (last stride 2); ``junk`` in between."""
    wide = torch.stack([tensor, torch.full_like(tensor, junk)], dim=-1)
    view = wide[..., 0]
    assert torch.equal(view, tensor) and not view.is_contiguous()
    return view


def column_major(table: torch.Tensor) -> torch.Tensor:
    view = table.t().contiguous().t()
    assert torch.equal(view, table) and not view.is_contiguous()
    return view


def attention_case():
    case = make_paged_case(q_lens=[5, 9, 3], k_lens=[30, 17, 41], block_size=7, device=DEVICE)
    key_limits = torch.tensor(
        [1, 9, 30, 12, 4] + [17, 3, 8, 16, 1, 11, 17, 5, 2] + [41, 20, 33],
        dtype=torch.int32,
        device=DEVICE,
    )
    key_gap = torch.tensor([[[3, 20], [25, 27]], [[0, 0], [5, 9]], [[7, 14], [40, 41]]])
    return case, key_limits, key_gap.to(torch.int32).to(DEVICE)


# (argument, how to make it strided): junk values that would change the result if read.
ATTENTION_VIEWS = [
    pytest.param("cu_seqlens_q", lambda t: column(t, 4), id="cu_seqlens_q"),
    pytest.param("seq_lens_k", lambda t: column(t, 0), id="seq_lens_k"),
    pytest.param("block_table", column_major, id="block_table-column-major"),
    pytest.param("block_table", lambda t: column(t, 0), id="block_table-stepped"),
    pytest.param("key_limits", lambda t: column(t, 0), id="key_limits"),
    pytest.param("key_gap", lambda t: column(t, 0), id="key_gap"),
    pytest.param("key_gap", lambda t: column(t[:, 0], 0), id="key_gap-2d"),
]


@pytest.mark.parametrize("name, make_view", ATTENTION_VIEWS)
def test_paged_attention_strided_index(name: str, make_view) -> None:
    case, key_limits, key_gap = attention_case()
    args = {
        "block_table": case.block_table,
        "cu_seqlens_q": case.cu_seqlens_q,
        "seq_lens_k": case.seq_lens_k,
        "key_limits": key_limits,
        "key_gap": key_gap,
    }
    args[name] = make_view(args[name])
    contiguous = {key: value.contiguous() for key, value in args.items()}
    want = reference.paged_attention(
        case.q, case.k_cache, case.v_cache, **contiguous, max_seqlen_q=9
    )
    got = kernels.paged_attention(
        case.q, case.k_cache, case.v_cache, **args, max_seqlen_q=9, out=nan_like(case.q)
    )
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize(
    "block_size, block_n",
    [
        pytest.param(40, 16, id="block_tiles-B40-N16"),  # whole tiles + remainders of 8
        pytest.param(24, 64, id="block_tiles-B24-N64"),  # pieces of 16 and 8 per tile
    ],
)
@pytest.mark.parametrize("make_view", [column_major, lambda t: column(t, 0)], ids=["cm", "step"])
def test_block_tiles_read_a_strided_block_table(block_size: int, block_n: int, make_view) -> None:
    # The piece loops read the table by entry (whole tiles), per piece and per row (remainders).
    case = make_paged_case(
        q_lens=[5, 9],
        k_lens=[3 * block_size + 5, 2 * block_n + 3],
        block_size=block_size,
        device=DEVICE,
    )
    assert kv_path(block_size, block_n) == "block_tiles"
    want = reference.paged_attention(*case.args(), max_seqlen_q=9)
    q, k_cache, v_cache, table, cu, lens = case.args()
    got = kernels.paged_attention(
        q,
        k_cache,
        v_cache,
        make_view(table),
        cu,
        lens,
        max_seqlen_q=9,
        block_m=16,
        block_n=block_n,
        out=nan_like(q),
    )
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)


def test_write_slots_strided_slot_mapping() -> None:
    # The junk is slot 0: a launcher reading ptr + t would write the null block.
    gen = torch.Generator().manual_seed(1)
    k_pool = torch.randn(40, 2, 8, generator=gen).to(DEVICE)
    v_pool = torch.randn(40, 2, 8, generator=gen).to(DEVICE)
    key, value = torch.randn(2, 6, 2, 8, generator=gen).to(DEVICE)
    slots = torch.tensor([9, 3, -1, 39, 17, 22], device=DEVICE)
    k_want, v_want = k_pool.clone(), v_pool.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_want[slot], v_want[slot] = key[t], value[t]
    kernels.write_slots(key, value, k_pool, v_pool, column(slots, 0))
    assert torch.equal(k_pool, k_want) and torch.equal(v_pool, v_want)


@pytest.mark.parametrize("strided", ["value", "key"])
def test_write_slots_value_laid_out_unlike_key(strided: str) -> None:
    # One of key/value is (heads, tokens, dim) transposed: its strides differ from the other's.
    gen = torch.Generator().manual_seed(2)
    k_pool, v_pool = torch.zeros(2, 30, 3, 16).to(DEVICE)
    plain = torch.randn(7, 3, 16, generator=gen).to(DEVICE)
    other = torch.randn(3, 7, 16, generator=gen).to(DEVICE).transpose(0, 1)
    key, value = (plain, other) if strided == "value" else (other, plain)
    assert key.stride() != value.stride()
    slots = torch.tensor([4, 29, 0, 11, 12, 13, 7], device=DEVICE)
    kernels.write_slots(key, value, k_pool, v_pool, slots)
    assert torch.equal(k_pool[slots], key) and torch.equal(v_pool[slots], value)
    untouched = torch.ones(30, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert not k_pool[untouched].any() and not v_pool[untouched].any()


@pytest.mark.parametrize("first_block", [0, 2])
def test_gather_blocks_strided_block_ids(first_block: int) -> None:
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(2, 6, 4, 2, 8, generator=gen).to(DEVICE)
    ids = torch.tensor([5, 2, 4, 1], dtype=torch.int32, device=DEVICE)
    stage_k = torch.full((20, 2, 8), float("nan"), device=DEVICE)
    stage_v = stage_k.clone()
    kernels.gather_blocks(
        k_cache, v_cache, column(ids, 0), stage_k, stage_v, first_block=first_block
    )
    for j, block in enumerate(ids.tolist()):
        rows = slice(j * 4, (j + 1) * 4)
        if j < first_block:
            assert stage_k[rows].isnan().all()
        else:
            assert torch.equal(stage_k[rows], k_cache[block])
            assert torch.equal(stage_v[rows], v_cache[block])
    assert stage_k[16:].isnan().all() and stage_v[16:].isnan().all()


@pytest.mark.parametrize("name", ["cu_seqlens_q", "seq_lens_k", "q_offsets", "block_table"])
def test_mixed_masks_strided_index(name: str) -> None:
    case = make_paged_case(q_lens=[6, 4], k_lens=[20, 12], block_size=5, device=DEVICE)
    spans = [[(2, 9), (14, 18)], [(9, 12)]]
    args = {
        "block_table": case.block_table,
        "cu_seqlens_q": case.cu_seqlens_q,
        "seq_lens_k": case.seq_lens_k,
        "q_offsets": torch.tensor([12, 5], dtype=torch.int32, device=DEVICE),
    }
    want = reference.mixed_mask_attention(case.q, case.k_cache, case.v_cache, **args, spans=spans)
    limits = key_limits_from_spans(
        spans, args["cu_seqlens_q"], args["seq_lens_k"], q_offsets=args["q_offsets"]
    )
    args[name] = column_major(args[name]) if name == "block_table" else column(args[name], 1)
    strided_limits = key_limits_from_spans(
        spans, args["cu_seqlens_q"], args["seq_lens_k"], q_offsets=args["q_offsets"]
    )
    assert torch.equal(strided_limits, limits)
    got = mixed_mask_attention(
        case.q, case.k_cache, case.v_cache, **args, spans=spans, max_seqlen_q=6
    )
    torch.testing.assert_close(got, want.to(got.dtype), atol=FP32_ATOL, rtol=0)


# seq_lens_k has one entry here (one row), which no stride can misplace; the batched case is
# test_paged_attention_strided_index's.
FUSED_VIEWS = ["video_slots", "action_slots", "block_table", "cu_seqlens_q", "key_gap"]


@pytest.mark.parametrize("staged", [False, True], ids=["paged", "staged"])
@pytest.mark.parametrize("name", FUSED_VIEWS)
def test_fused_op_strided_index(name: str, staged: bool) -> None:
    tensors, inputs = make_forward(1, staged=staged, layer=1)
    state_direct, state_op = make_state(), make_state()
    want = direct_calls(tensors, inputs, fused.PoolTensors.build(*state_direct))
    value = getattr(inputs, name)
    view = column(value, 0)
    got = fused.write_attend(
        *tensors, fused.PoolTensors.build(*state_op), inputs._replace(**{name: view})
    )
    assert torch.equal(got, want)
    for a, b in zip(state_op, state_direct, strict=True):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), "mutated state differs"
