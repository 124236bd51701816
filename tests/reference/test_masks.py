"""The per-segment mixed-mask oracle: segment building, validation, and float64 dense agreement.

``mixed_mask_cases`` and ``dense_mixed_mask_attention`` are shared with
``tests/kernels/test_masks.py``: the dense oracle builds the boolean mask query by query from the
definition, sharing nothing with either the segment builder or the kernel's key limits.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from paged_video import reference
from paged_video.reference.attention import gather_sequence
from paged_video.reference.masks import (
    MaskSegment,
    mask_segments,
    per_segment_attention,
    segments_for_batch,
    segments_line_up,
)
from tests.helpers import DEVICE
from tests.kernels.paged_case import PagedCase, make_paged_case

ORACLE_ATOL = 1e-12  # two float64 computations of the same attention


# --- shared with tests/kernels/test_masks.py ------------------------------------------------


class MixedMaskCase:
    """A paged batch and its mask: ``spans`` as passed (shared or per row), ``spans_by_row``
    the same spans for each row, ``q_offsets`` as passed (None, a list or a tensor).

    A plain class, not a dataclass, so hypothesis reports a failing case by its ``__repr__``
    (shapes and mask) rather than by printing every tensor.
    """

    def __init__(
        self,
        paged: PagedCase,
        spans: list,
        spans_by_row: list[list[tuple[int, int]]],
        q_offsets: list[int] | torch.Tensor | None,
    ) -> None:
        self.paged = paged
        self.spans = spans
        self.spans_by_row = spans_by_row
        self.q_offsets = q_offsets

    def row_offsets(self) -> list[int]:
        if self.q_offsets is not None:
            return [int(offset) for offset in self.q_offsets]
        starts = self.paged.cu_seqlens_q.tolist()
        k_lens = self.paged.seq_lens_k.tolist()
        return [k - (b - a) for k, (a, b) in zip(k_lens, pairwise(starts), strict=True)]

    def __repr__(self) -> str:  # the shapes and the mask, not the tensors
        paged = self.paged
        starts = paged.cu_seqlens_q.tolist()
        return (
            f"MixedMaskCase(q_lens={[b - a for a, b in pairwise(starts)]}, "
            f"k_lens={paged.seq_lens_k.tolist()}, block_size={paged.k_cache.shape[1]}, "
            f"heads={paged.q.shape[1]}/{paged.k_cache.shape[2]}, spans={self.spans}, "
            f"q_offsets={self.q_offsets})"
        )


def random_spans(draw, seq_len: int) -> list[tuple[int, int]]:
    """Sorted, disjoint spans inside ``[0, seq_len)``, touching ones included."""
    cuts = sorted(draw(st.sets(st.integers(0, seq_len), max_size=7)))
    keep = draw(st.lists(st.booleans(), min_size=len(cuts), max_size=len(cuts)))
    return [(a, b) for a, b, kept in zip(cuts, cuts[1:], keep, strict=False) if kept]


@st.composite
def mixed_mask_cases(draw, *, max_rows: int = 3, max_keys: int = 40) -> MixedMaskCase:
    batch = draw(st.integers(1, max_rows))
    k_lens = draw(st.lists(st.integers(1, max_keys), min_size=batch, max_size=batch))
    # Row 0 always has queries; later rows may have none.
    q_lens = [draw(st.integers(1 if row == 0 else 0, k)) for row, k in enumerate(k_lens)]
    bottom_right = draw(st.booleans())
    offsets = [
        k_len - q_len if bottom_right else draw(st.integers(0, k_len - q_len))
        for k_len, q_len in zip(k_lens, q_lens, strict=True)
    ]
    if draw(st.booleans()):
        spans = random_spans(draw, min(k_lens))  # shared: must fit the shortest row
        spans_by_row = [spans] * batch
    else:
        spans = spans_by_row = [random_spans(draw, k_len) for k_len in k_lens]
    num_kv_heads = draw(st.sampled_from([1, 2]))
    paged = make_paged_case(
        q_lens=q_lens,
        k_lens=k_lens,
        block_size=draw(st.sampled_from([1, 3, 8, 16, 24])),
        num_heads=num_kv_heads * draw(st.sampled_from([1, 2])),  # GQA half the time
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from([8, 12])),
        device=DEVICE,
        seed=draw(st.integers(0, 2**16)),
    )
    if bottom_right and draw(st.booleans()):
        q_offsets = None
    elif draw(st.booleans()):
        q_offsets = torch.tensor(offsets, dtype=torch.int32)
    else:
        q_offsets = offsets
    return MixedMaskCase(paged, spans, spans_by_row, q_offsets)


def explicit_mask(
    spans: list[tuple[int, int]], q_offset: int, q_len: int, k_len: int
) -> torch.Tensor:
    """The definition, query by query: inside a span ``[a, b)`` keys ``[0, b)``, else ``[0, p]``."""
    mask = torch.zeros(q_len, k_len, dtype=torch.bool)
    for i in range(q_len):
        p = q_offset + i
        limit = next((b for a, b in spans if a <= p < b), p + 1)
        mask[i, :limit] = True
    return mask


def dense_mixed_mask_attention(case: MixedMaskCase) -> torch.Tensor:
    """Float64 dense attention of every row under its explicit mask, packed like ``q``."""
    paged = case.paged
    out = torch.zeros(paged.q.shape, dtype=torch.float64, device=paged.q.device)
    starts = paged.cu_seqlens_q.tolist()
    for row, (k_len, offset) in enumerate(
        zip(paged.seq_lens_k.tolist(), case.row_offsets(), strict=True)
    ):
        lo, hi = starts[row], starts[row + 1]
        if lo == hi:
            continue
        keys = gather_sequence(paged.k_cache, paged.block_table[row], k_len)
        values = gather_sequence(paged.v_cache, paged.block_table[row], k_len)
        mask = explicit_mask(case.spans_by_row[row], offset, hi - lo, k_len)
        out[lo:hi] = reference.dense_attention(paged.q[lo:hi], keys, values, mask=mask)
    return out


def oracle(case: MixedMaskCase, **kwargs) -> torch.Tensor:
    """The per-segment oracle in float64 (a float64 ``q`` keeps the reference in float64)."""
    paged = case.paged
    return reference.mixed_mask_attention(
        paged.q.double(), *paged.args()[1:], spans=case.spans, q_offsets=case.q_offsets, **kwargs
    )


def small_case(
    *, q_lens: list[int], k_lens: list[int], block_size: int = 8, seed: int = 0
) -> PagedCase:
    return make_paged_case(
        q_lens=q_lens,
        k_lens=k_lens,
        block_size=block_size,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        device=DEVICE,
        seed=seed,
    )


# --- segment builder ------------------------------------------------------------------------


def causal(start: int, end: int) -> MaskSegment:
    return MaskSegment(start, end, end, causal=True)


def full(start: int, end: int, key_end: int) -> MaskSegment:
    return MaskSegment(start, end, key_end, causal=False)


@pytest.mark.parametrize(
    ("spans", "q_offset", "q_len", "seq_len", "expected"),
    [
        pytest.param([], 5, 5, 10, [causal(5, 10)], id="no-spans"),
        pytest.param([(0, 10)], 0, 10, 10, [full(0, 10, 10)], id="span-covers-everything"),
        pytest.param([(2, 5)], 5, 4, 12, [causal(5, 9)], id="span-ends-at-query-start"),
        pytest.param([(9, 12)], 5, 4, 12, [causal(5, 9)], id="span-starts-at-query-end"),
        pytest.param([(5, 7)], 5, 4, 12, [full(5, 7, 7), causal(7, 9)], id="span-at-query-start"),
        pytest.param([(7, 9)], 5, 4, 12, [causal(5, 7), full(7, 9, 9)], id="span-at-query-end"),
        pytest.param([(2, 20)], 5, 4, 20, [full(5, 9, 20)], id="shard-inside-span"),
        pytest.param([(0, 7)], 5, 4, 12, [full(5, 7, 7), causal(7, 9)], id="shard-straddles-end"),
        pytest.param([(7, 12)], 5, 4, 12, [causal(5, 7), full(7, 9, 12)], id="span-past-shard"),
        pytest.param(
            [(0, 4), (4, 8)],
            0,
            10,
            10,
            [full(0, 4, 4), full(4, 8, 8), causal(8, 10)],
            id="touching-spans-stay-apart",
        ),
        pytest.param(
            [(2, 4), (6, 8)],
            0,
            10,
            10,
            [causal(0, 2), full(2, 4, 4), causal(4, 6), full(6, 8, 8), causal(8, 10)],
            id="five-segments",
        ),
        pytest.param([(1, 3)], 4, 0, 10, [], id="no-queries"),
    ],
)
def test_mask_segments(spans, q_offset, q_len, seq_len, expected) -> None:
    assert mask_segments(spans, q_offset=q_offset, q_len=q_len, seq_len=seq_len) == expected


@pytest.mark.parametrize(
    ("spans", "q_offset", "q_len", "error", "match"),
    [
        pytest.param([(5, 7), (1, 3)], 0, 10, ValueError, "sorted", id="unsorted"),
        pytest.param([(1, 5), (4, 7)], 0, 10, ValueError, "sorted and disjoint", id="overlapping"),
        pytest.param([(8, 12)], 0, 10, ValueError, "inside the sequence", id="past-the-end"),
        pytest.param([(-1, 3)], 0, 10, ValueError, "inside the sequence", id="negative-start"),
        pytest.param([(3, 3)], 0, 10, ValueError, "non-empty", id="empty-span"),
        pytest.param([(1, 2, 3)], 0, 10, TypeError, "pair of ints", id="not-a-pair"),
        pytest.param([(1.0, 2)], 0, 10, TypeError, "pair of ints", id="not-ints"),
        pytest.param([], 8, 3, ValueError, "query range", id="queries-past-the-end"),
        pytest.param([], -1, 3, ValueError, "query range", id="negative-offset"),
    ],
)
def test_mask_segments_rejects(spans, q_offset, q_len, error, match) -> None:
    with pytest.raises(error, match=match):
        mask_segments(spans, q_offset=q_offset, q_len=q_len, seq_len=10)


# --- batch validation -----------------------------------------------------------------------


def test_per_row_spans_must_match_batch() -> None:
    paged = small_case(q_lens=[3, 3], k_lens=[10, 10])
    with pytest.raises(ValueError, match=r"spans has 3 rows, expected one per row \(batch = 2\)"):
        segments_for_batch([[(0, 2)], [], []], paged.cu_seqlens_q, paged.seq_lens_k)


def test_shared_spans_must_fit_every_row() -> None:
    paged = small_case(q_lens=[3, 3], k_lens=[12, 8])
    with pytest.raises(ValueError, match=r"spans \(shared, checked against row 1\)"):
        segments_for_batch([(2, 10)], paged.cu_seqlens_q, paged.seq_lens_k)


@pytest.mark.parametrize(
    ("cu_seqlens_q", "match"),
    [
        pytest.param([0, 4, 2], "without decreasing", id="decreasing"),
        pytest.param([1, 3, 6], "from 0", id="does-not-start-at-0"),
        pytest.param([0, 3, 5], "total_q = 6", id="stops-short"),
    ],
)
def test_rows_must_cover_the_queries(cu_seqlens_q: list[int], match: str) -> None:
    paged = small_case(q_lens=[3, 3], k_lens=[10, 10])
    with pytest.raises(ValueError, match=match):
        per_segment_attention(
            *paged.args()[:4],
            torch.tensor(cu_seqlens_q, dtype=torch.int32, device=DEVICE),
            paged.seq_lens_k,
            row_segments=[[causal(7, 10)], [causal(7, 10)]],
        )


@pytest.mark.parametrize(
    ("segments", "match"),
    [
        pytest.param([causal(7, 8), causal(9, 10)], "starts at 9, expected 8", id="gap"),
        pytest.param([full(7, 9, 10), causal(8, 10)], "starts at 8, expected 9", id="overlap"),
        pytest.param([causal(7, 9)], "end at 9, expected 10", id="stops-short"),
        pytest.param([causal(6, 10)], "starts at 6, expected 7", id="starts-early"),
        pytest.param([MaskSegment(7, 10, 9, causal=True)], "key_end must equal", id="bad-causal"),
        pytest.param([full(7, 10, 11)], "key_end <= seq_len", id="keys-past-the-end"),
    ],
)
def test_segments_must_tile_the_queries(segments: list[MaskSegment], match: str) -> None:
    paged = small_case(q_lens=[3], k_lens=[10])
    with pytest.raises(ValueError, match=match):
        per_segment_attention(*paged.args(), row_segments=[segments])


def test_batched_dispatch_needs_rows_that_line_up() -> None:
    paged = small_case(q_lens=[4, 4], k_lens=[10, 10])
    rows = segments_for_batch([[(6, 8)], [(9, 10)]], paged.cu_seqlens_q, paged.seq_lens_k)
    with pytest.raises(ValueError, match=r"line up.*row 0 .*row 1"):
        per_segment_attention(*paged.args(), row_segments=rows, batch_rows=True)


# --- the oracle against float64 dense attention ---------------------------------------------


@given(case=mixed_mask_cases())
def test_oracle_matches_dense_explicit_mask(case: MixedMaskCase) -> None:
    got = oracle(case)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, dense_mixed_mask_attention(case), atol=ORACLE_ATOL, rtol=0)


class CallCounter:
    """``reference.paged_attention`` that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        self.calls += 1
        return reference.paged_attention(*args, **kwargs)


@given(case=mixed_mask_cases())
def test_batched_and_per_row_dispatch_agree(case: MixedMaskCase) -> None:
    paged = case.paged
    rows = segments_for_batch(
        case.spans, paged.cu_seqlens_q, paged.seq_lens_k, q_offsets=case.q_offsets
    )
    per_row, batched = CallCounter(), CallCounter()
    kwargs = {"row_segments": rows, "q_offsets": case.q_offsets}
    one_call_each = per_segment_attention(
        paged.q.double(), *paged.args()[1:], attend=per_row, **kwargs
    )
    assert per_row.calls == sum(len(segs) for segs in rows)
    if segments_line_up(rows):
        shared = per_segment_attention(
            paged.q.double(), *paged.args()[1:], attend=batched, batch_rows=True, **kwargs
        )
        assert batched.calls == max(len(segs) for segs in rows)
        torch.testing.assert_close(shared, one_call_each, atol=ORACLE_ATOL, rtol=0)


def test_five_segments_dispatch_counts() -> None:
    """Two rows whose five segments line up: five batched calls, or ten one-row calls."""
    paged = small_case(q_lens=[10, 10], k_lens=[14, 20])
    spans = [[(6, 8), (10, 12)], [(12, 14), (16, 18)]]
    rows = segments_for_batch(spans, paged.cu_seqlens_q, paged.seq_lens_k)
    assert [len(segs) for segs in rows] == [5, 5]
    counter = CallCounter()
    reference.mixed_mask_attention(*paged.args(), spans=spans, attend=counter)
    assert counter.calls == 5
    counter = CallCounter()
    per_segment_attention(*paged.args(), row_segments=rows, attend=counter)
    assert counter.calls == 10
