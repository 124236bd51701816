"""The one-launch mixed-mask path against the per-segment oracle and float64 dense attention."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from hypothesis import given
from triton.runtime.jit import KernelInterface

from paged_video import kernels, reference
from paged_video.kernels._runtime import interpreter_active
from paged_video.kernels.masks import key_limits_from_spans, mixed_mask_attention
from paged_video.reference.masks import per_segment_attention, segments_for_batch
from tests.helpers import DEVICE, ON_GPU, nan_like
from tests.kernels.paged_case import PagedCase, make_paged_case
from tests.reference.test_masks import (
    MixedMaskCase,
    dense_mixed_mask_attention,
    mixed_mask_cases,
    oracle,
)

FP32_ATOL = 2e-5  # ieee dot precision in fp32 against float64
BF16_ATOL = 3e-2
needs_triton = pytest.mark.skipif(
    not (ON_GPU or interpreter_active()),
    reason="Triton launches happen only on a GPU or under the interpreter",
)


def run_one_launch(case: MixedMaskCase) -> torch.Tensor:
    paged = case.paged
    out = nan_like(paged.q)
    got = mixed_mask_attention(
        *paged.args(),
        spans=case.spans,
        q_offsets=case.q_offsets,
        max_seqlen_q=paged.max_seqlen_q,
        out=out,
    )
    assert got is out
    assert not torch.isnan(got).any(), "NaN left: an unwritten output or a poisoned read"
    return got


@given(case=mixed_mask_cases())
def test_one_launch_matches_oracle_and_dense(case: MixedMaskCase) -> None:
    got = run_one_launch(case).double()
    torch.testing.assert_close(got, oracle(case), atol=FP32_ATOL, rtol=0)
    torch.testing.assert_close(got, dense_mixed_mask_attention(case), atol=FP32_ATOL, rtol=0)


def edge_case(
    q_lens: list[int], k_lens: list[int], spans: list, q_offsets: list[int] | None = None
) -> MixedMaskCase:
    paged = make_paged_case(
        q_lens=q_lens,
        k_lens=k_lens,
        block_size=8,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        device=DEVICE,
    )
    shared = not spans or not isinstance(spans[0], list)
    spans_by_row = [spans] * len(k_lens) if shared else spans
    return MixedMaskCase(paged, spans, spans_by_row, q_offsets)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(edge_case([6, 4], [20, 9], []), id="no-spans"),
        pytest.param(edge_case([9, 9], [9, 9], [(0, 9)]), id="span-covers-everything"),
        pytest.param(edge_case([6], [20], [(2, 6)], [6]), id="span-ends-at-query-start"),
        pytest.param(edge_case([6], [20], [(6, 9)], [6]), id="span-starts-at-query-start"),
        pytest.param(edge_case([6], [20], [(9, 12)], [6]), id="span-ends-at-query-end"),
        pytest.param(edge_case([6], [20], [(12, 16)], [6]), id="span-starts-at-query-end"),
        pytest.param(edge_case([6], [20], [(10, 14), (16, 20)]), id="span-ends-the-sequence"),
        pytest.param(edge_case([4], [24], [(3, 21)], [6]), id="shard-inside-span"),
        pytest.param(edge_case([7, 5], [16, 16], [(3, 11)], [2, 10]), id="shards-straddle-span"),
        pytest.param(
            edge_case([10, 3, 0, 8], [12, 30, 5, 8], [[(2, 4), (6, 12)], [(27, 30)], [], []]),
            id="rows-that-do-not-line-up",
        ),
    ],
)
def test_edge_cases(case: MixedMaskCase) -> None:
    got = run_one_launch(case).double()
    torch.testing.assert_close(got, dense_mixed_mask_attention(case), atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [24, 256], ids=["B24-per-row-lookup", "B256-contiguous"])
def test_spans_across_query_and_key_tiles(block_size: int) -> None:
    """Long enough for several query and key tiles (256 under the interpreter); spans straddle
    the query start, a key-tile edge (512) and a query-tile edge (global 556)."""
    paged = make_paged_case(
        q_lens=[300],
        k_lens=[600],
        block_size=block_size,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        device=DEVICE,
    )
    spans = [(290, 320), (500, 530), (550, 560)]
    case = MixedMaskCase(paged, spans, [spans], None)
    got = run_one_launch(case).double()
    torch.testing.assert_close(got, dense_mixed_mask_attention(case), atol=FP32_ATOL, rtol=0)


def test_no_spans_is_bottom_right_causal() -> None:
    case = edge_case([6, 4], [20, 9], [])
    causal = kernels.paged_attention(
        *case.paged.args(), max_seqlen_q=case.paged.max_seqlen_q, causal=True
    )
    torch.testing.assert_close(run_one_launch(case), causal, atol=FP32_ATOL, rtol=0)


def test_span_over_everything_is_full_attention() -> None:
    case = edge_case([5, 9], [9, 9], [(0, 9)], [2, 0])
    full = kernels.paged_attention(*case.paged.args(), max_seqlen_q=case.paged.max_seqlen_q)
    torch.testing.assert_close(run_one_launch(case), full, atol=FP32_ATOL, rtol=0)


def test_key_limits_from_spans_values() -> None:
    # Row 0: queries at 4..9 of 10 keys, span [5, 8). Row 1: queries at 2..4, span [0, 6).
    cu_seqlens_q = torch.tensor([0, 6, 9], dtype=torch.int32)
    seq_lens_k = torch.tensor([10, 8], dtype=torch.int32)
    limits = key_limits_from_spans([[(5, 8)], [(0, 6)]], cu_seqlens_q, seq_lens_k, q_offsets=[4, 2])
    assert limits.dtype == torch.int32
    assert limits.tolist() == [5, 8, 8, 8, 9, 10, 6, 6, 6]


@pytest.mark.parametrize(
    ("spans", "q_offsets", "error", "match"),
    [
        pytest.param([(5, 7), (1, 3)], None, ValueError, "sorted", id="unsorted"),
        pytest.param([(1, 5), (4, 7)], None, ValueError, "must not overlap", id="overlapping"),
        pytest.param([(8, 13)], None, ValueError, r"row 1\)\[0\].*<= 12", id="outside-a-row"),
        pytest.param([(3, 3)], None, ValueError, "non-empty", id="empty-span"),
        pytest.param([(1, 2, 3)], None, TypeError, "pair of ints", id="not-a-pair"),
        pytest.param("0:4", None, TypeError, "spans must be a list", id="not-a-list"),
        pytest.param([[(0, 2)]], None, ValueError, r"spans has 1 rows.*batch = 2", id="rows"),
        pytest.param([], [0], ValueError, r"q_offsets must have shape \(2,\)", id="offsets-len"),
        pytest.param([], [0, 10], ValueError, r"q_offsets\[1\]", id="queries-past-keys"),
        pytest.param([], [-1, 0], ValueError, r"q_offsets\[0\]", id="negative-offset"),
    ],
)
def test_rejects_bad_masks(spans, q_offsets, error, match) -> None:
    paged = make_paged_case(q_lens=[4, 3], k_lens=[16, 12], block_size=8, device=DEVICE)
    with pytest.raises(error, match=match):
        mixed_mask_attention(
            *paged.args(), spans=spans, q_offsets=q_offsets, max_seqlen_q=paged.max_seqlen_q
        )


@pytest.mark.parametrize(
    ("cu_seqlens_q", "match"),
    [
        pytest.param([0, 9, 7], "never decrease", id="decreasing"),
        pytest.param([0, 2, 6], "end at total_q = 7", id="stops-short"),
        pytest.param([1, 4, 7], "start at 0", id="does-not-start-at-0"),
    ],
)
def test_rows_must_cover_the_queries(cu_seqlens_q: list[int], match: str) -> None:
    paged = make_paged_case(q_lens=[4, 3], k_lens=[16, 12], block_size=8, device=DEVICE)
    cu = torch.tensor(cu_seqlens_q, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        mixed_mask_attention(
            *paged.args()[:4], cu, paged.seq_lens_k, spans=[], max_seqlen_q=paged.max_seqlen_q
        )


def test_key_limits_reject_wrong_index_dtype() -> None:
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype int32"):
        key_limits_from_spans([], torch.tensor([0, 2]), torch.tensor([4], dtype=torch.int32))


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(torch.float32, id="fp32"),
        pytest.param(
            torch.bfloat16,
            id="bf16",
            marks=pytest.mark.skipif(not ON_GPU, reason="the interpreter computes bf16 wrongly"),
        ),
    ],
)
def test_dtypes(dtype: torch.dtype) -> None:
    paged = make_paged_case(
        q_lens=[7, 5], k_lens=[19, 40], block_size=16, head_dim=24, dtype=dtype, device=DEVICE
    )
    case = MixedMaskCase(paged, [(1, 4), (14, 18)], [[(1, 4), (14, 18)]] * 2, [12, 30])
    got = run_one_launch(case)
    assert got.dtype == dtype
    atol = FP32_ATOL if dtype == torch.float32 else BF16_ATOL
    torch.testing.assert_close(got.double(), oracle(case), atol=atol, rtol=0)


# --- launches per call ----------------------------------------------------------------------


@contextmanager
def count_triton_launches() -> Iterator[list[str]]:
    """Record every Triton kernel launch (``kernel[grid](...)``) made inside the block."""
    launches: list[str] = []
    launch_proxy = KernelInterface.__getitem__

    def counting_getitem(kernel: KernelInterface, grid):
        launch = launch_proxy(kernel, grid)

        def counted(*args, **kwargs):
            launches.append(getattr(kernel, "__name__", type(kernel).__name__))
            return launch(*args, **kwargs)

        return counted

    with mock.patch.object(KernelInterface, "__getitem__", counting_getitem):
        yield launches


def five_segment_batch() -> tuple[PagedCase, list]:
    """Two rows of 10 queries, each split causal / full / causal / full / causal."""
    paged = make_paged_case(
        q_lens=[10, 10],
        k_lens=[14, 20],
        block_size=8,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        device=DEVICE,
    )
    return paged, [[(6, 8), (10, 12)], [(12, 14), (16, 18)]]


@needs_triton
def test_launch_counts_five_segments() -> None:
    paged, spans = five_segment_batch()
    rows = segments_for_batch(spans, paged.cu_seqlens_q, paged.seq_lens_k)
    assert [len(segs) for segs in rows] == [5, 5]
    with count_triton_launches() as one_launch:
        fused = mixed_mask_attention(
            *paged.args(), spans=spans, max_seqlen_q=10, out=nan_like(paged.q)
        )
    with count_triton_launches() as batched:
        per_segment = per_segment_attention(
            *paged.args(), row_segments=rows, batch_rows=True, attend=kernels.paged_attention
        )
    with count_triton_launches() as per_row:
        per_segment_attention(*paged.args(), row_segments=rows, attend=kernels.paged_attention)
    assert (len(one_launch), len(batched), len(per_row)) == (1, 5, 10)
    torch.testing.assert_close(fused, per_segment, atol=FP32_ATOL, rtol=0)


@needs_triton
def test_rows_that_do_not_line_up_still_take_one_launch() -> None:
    paged = make_paged_case(
        q_lens=[10, 6, 4], k_lens=[14, 20, 9], block_size=3, head_dim=8, device=DEVICE
    )
    spans = [[(6, 8), (10, 12)], [(19, 20)], []]
    with count_triton_launches() as launches:
        got = mixed_mask_attention(
            *paged.args(), spans=spans, max_seqlen_q=10, out=nan_like(paged.q)
        )
    assert len(launches) == 1
    want = reference.mixed_mask_attention(paged.q.double(), *paged.args()[1:], spans=spans)
    torch.testing.assert_close(got.double(), want, atol=FP32_ATOL, rtol=0)
