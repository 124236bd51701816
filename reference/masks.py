"""Mixed causal / full attention masks, the reference way: one attention call per segment.

Positions are global: key ``j`` of a sequence is position ``j`` (keys start at 0) and the queries
of a row sit at ``q_offset .. q_offset + q_len - 1``. A *full span* ``[a, b)`` (half-open) is a
bidirectional block: a query at position ``p`` with ``a <= p < b`` sees keys ``[0, b)``, even
past the end of a query shard. Every other query sees keys ``[0, p]`` (causal). With
``q_offset = k_len - q_len`` that is FlashAttention's bottom-right alignment.

The oracle splits each row's queries into segments that are causal or full throughout and calls
attention once per segment: a causal segment ``[s, e)`` attends bottom-right causally over keys
``[0, e)``; a full segment over keys ``[0, b)`` without a mask. It is deliberately naive (Python
loops over rows, spans and segments) and shares no code with ``kernels/masks.py``, so each checks
the other.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from itertools import accumulate, pairwise
from typing import NamedTuple

import torch
from torch import Tensor

from paged_video.reference.attention import paged_attention

Span = tuple[int, int]
AttentionFn = Callable[..., Tensor]


class MaskSegment(NamedTuple):
    """Queries ``[start, end)`` (global positions) that all see the keys the same way.

    ``causal``: a query at ``p`` sees keys ``[0, p]`` (then ``key_end == end``). Otherwise the
    segment is (part of) a full span and every query sees keys ``[0, key_end)``, the span's end.
    """

    start: int
    end: int
    key_end: int
    causal: bool


def check_spans(spans: Sequence[Span], seq_len: int, *, name: str = "spans") -> list[Span]:
    """The spans as a list of int pairs; raises unless sorted, disjoint and within ``[0, seq_len]``.

    Touching spans (``[0, 4), [4, 8)``) are disjoint: each keeps its own key limit.
    """
    checked: list[Span] = []
    for index, span in enumerate(spans):
        if isinstance(span, (str, bytes)) or not isinstance(span, Sequence) or len(span) != 2:
            raise TypeError(f"{name}[{index}] must be a (start, end) pair of ints, got {span!r}")
        try:
            start, end = operator.index(span[0]), operator.index(span[1])
        except TypeError:
            raise TypeError(
                f"{name}[{index}] must be a (start, end) pair of ints, got {span!r}"
            ) from None
        if not 0 <= start < end <= seq_len:
            raise ValueError(
                f"{name}[{index}] = [{start}, {end}) must satisfy 0 <= start < end <= {seq_len} "
                "(non-empty and inside the sequence)"
            )
        if checked and start < checked[-1][1]:
            raise ValueError(
                f"{name}[{index}] = [{start}, {end}) starts before the previous span "
                f"[{checked[-1][0]}, {checked[-1][1]}) ends: spans must be sorted and disjoint"
            )
        checked.append((start, end))
    return checked


def check_query_range(q_offset: int, q_len: int, seq_len: int, *, row: int = 0) -> None:
    """Raise unless queries ``[q_offset, q_offset + q_len)`` are positions of the sequence."""
    if not 0 <= q_offset <= q_offset + q_len <= seq_len:
        raise ValueError(
            f"row {row}: query range [{q_offset}, {q_offset + q_len}) must lie inside the "
            f"sequence [0, {seq_len}) (q_offsets >= 0 and q_offset + q_len <= seq_lens_k)"
        )


def mask_segments(
    spans: Sequence[Span],
    *,
    q_offset: int,
    q_len: int,
    seq_len: int,
    row: int = 0,
    name: str = "spans",
) -> list[MaskSegment]:
    """Split queries ``[q_offset, q_offset + q_len)`` of a ``seq_len``-key sequence into segments.

    Spans are clipped to the query range; a clipped full segment keeps its span's end as its key
    limit, so a query shard that ends inside a span still sees the rest of the span. The
    segments are in order and tile the query range exactly (none when ``q_len == 0``).
    """
    check_query_range(q_offset, q_len, seq_len, row=row)
    q_end = q_offset + q_len
    segments: list[MaskSegment] = []
    cursor = q_offset
    for start, end in check_spans(spans, seq_len, name=name):
        lo, hi = max(start, q_offset), min(end, q_end)
        if lo >= hi:
            continue
        if cursor < lo:
            segments.append(MaskSegment(cursor, lo, lo, causal=True))
        segments.append(MaskSegment(lo, hi, end, causal=False))
        cursor = hi
    if cursor < q_end:
        segments.append(MaskSegment(cursor, q_end, q_end, causal=True))
    return segments


def check_segments_cover(
    segments: Sequence[MaskSegment], *, q_offset: int, q_len: int, seq_len: int, row: int = 0
) -> None:
    """Raise unless ``segments`` tile ``[q_offset, q_offset + q_len)`` in order, gap-free.

    Also checks what a segment's call needs: keys ``[0, key_end)`` exist, and a causal segment's
    key range ends with its queries (bottom-right alignment).
    """
    check_query_range(q_offset, q_len, seq_len, row=row)
    cursor = q_offset
    for index, seg in enumerate(segments):
        where = f"segments of row {row}, segment {index} {tuple(seg)}"
        if seg.start != cursor:
            raise ValueError(
                f"{where} starts at {seg.start}, expected {cursor}: segments must cover the "
                f"query range [{q_offset}, {q_offset + q_len}) contiguously"
            )
        if seg.end <= seg.start:
            raise ValueError(f"{where} is empty: a segment needs start < end")
        if seg.causal and seg.key_end != seg.end:
            raise ValueError(f"{where} is causal, so key_end must equal end ({seg.end})")
        if not seg.end <= seg.key_end <= seq_len:
            raise ValueError(f"{where} needs end <= key_end <= seq_len ({seq_len})")
        cursor = seg.end
    if cursor != q_offset + q_len:
        raise ValueError(
            f"segments of row {row} end at {cursor}, expected {q_offset + q_len}: segments must "
            f"cover the query range [{q_offset}, {q_offset + q_len}) contiguously"
        )


def check_packing(
    cu_seqlens_q: Tensor, seq_lens_k: Tensor, total_q: int
) -> tuple[list[int], list[int], list[int]]:
    """Host copies ``(row starts, q_lens, k_lens)``; raises unless the rows pack ``total_q``
    queries in order, each query in exactly one row."""
    if cu_seqlens_q.dim() != 1 or seq_lens_k.dim() != 1:
        raise ValueError(
            f"cu_seqlens_q (batch + 1,) and seq_lens_k (batch,) must be 1-D, got shapes "
            f"{tuple(cu_seqlens_q.shape)} and {tuple(seq_lens_k.shape)}"
        )
    starts, lengths_k = cu_seqlens_q.tolist(), seq_lens_k.tolist()
    if len(starts) != len(lengths_k) + 1:
        raise ValueError(
            f"cu_seqlens_q must have batch + 1 = {len(lengths_k) + 1} entries, got {len(starts)}"
        )
    steps_ok = all(a <= b for a, b in pairwise(starts))
    if starts[0] != 0 or starts[-1] != total_q or not steps_ok:
        raise ValueError(
            f"cu_seqlens_q must rise from 0 to total_q = {total_q} without decreasing, so the "
            f"rows cover the query contiguously; got {starts}"
        )
    if any(k < 0 for k in lengths_k):
        raise ValueError(f"seq_lens_k must be >= 0, got {lengths_k}")
    return starts, [b - a for a, b in pairwise(starts)], lengths_k


def rows_of_spans(spans: Sequence, batch: int) -> list[tuple[str, Sequence]]:
    """``(name, spans)`` for each row. ``spans`` is one list of ``(start, end)`` pairs shared by
    every row, or one such list per row (a list whose entries are all lists of pairs)."""
    if isinstance(spans, (str, bytes)) or not isinstance(spans, Sequence):
        raise TypeError(f"spans must be a list of (start, end) pairs, got {type(spans).__name__}")
    per_row = len(spans) > 0 and all(
        isinstance(entry, Sequence) and all(isinstance(pair, Sequence) for pair in entry)
        for entry in spans
    )
    if not per_row:
        return [(f"spans (shared, checked against row {row})", spans) for row in range(batch)]
    if len(spans) != batch:
        raise ValueError(f"spans has {len(spans)} rows, expected one per row (batch = {batch})")
    return [(f"spans[{row}]", row_spans) for row, row_spans in enumerate(spans)]


def row_offsets(
    q_offsets: Sequence[int] | Tensor | None, q_lens: list[int], lengths_k: list[int]
) -> list[int]:
    """Each row's first query position; by default ``k_len - q_len`` (queries end the row)."""
    if q_offsets is None:
        return [k - n for k, n in zip(lengths_k, q_lens, strict=True)]
    offsets = q_offsets.tolist() if isinstance(q_offsets, Tensor) else list(q_offsets)
    if len(offsets) != len(lengths_k):
        raise ValueError(
            f"q_offsets must have one entry per row ({len(lengths_k)}), got {len(offsets)}"
        )
    return [operator.index(offset) for offset in offsets]


def segments_for_batch(
    spans: Sequence,
    cu_seqlens_q: Tensor,
    seq_lens_k: Tensor,
    *,
    q_offsets: Sequence[int] | Tensor | None = None,
) -> list[list[MaskSegment]]:
    """Each row's segments (see :func:`mask_segments`)."""
    _, q_lens, lengths_k = check_packing(cu_seqlens_q, seq_lens_k, int(cu_seqlens_q[-1]))
    offsets = row_offsets(q_offsets, q_lens, lengths_k)
    return [
        mask_segments(
            row_spans,
            q_offset=offsets[row],
            q_len=q_lens[row],
            seq_len=lengths_k[row],
            row=row,
            name=name,
        )
        for row, (name, row_spans) in enumerate(rows_of_spans(spans, len(lengths_k)))
    ]


def segments_line_up(row_segments: Sequence[Sequence[MaskSegment]]) -> bool:
    """True when the rows with queries have the same number of segments, causal in the same
    places, so segment ``s`` of every row can go into one packed call."""
    kinds = {tuple(seg.causal for seg in segs) for segs in row_segments if segs}
    return len(kinds) <= 1


def per_segment_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens_k: Tensor,
    *,
    row_segments: Sequence[Sequence[MaskSegment]],
    q_offsets: Sequence[int] | Tensor | None = None,
    softmax_scale: float | None = None,
    batch_rows: bool = False,
    attend: AttentionFn = paged_attention,
) -> Tensor:
    """Attention under the mixed mask by one ``attend`` call per segment (the reference way).

    ``row_segments[i]`` must tile row i's queries (see :func:`mask_segments`). ``batch_rows``
    packs segment ``s`` of every row into one call (as many calls as segments per row) and then
    requires the rows to line up; otherwise every segment of every row is its own call.
    ``attend`` has :func:`reference.paged_attention`'s signature (the Triton kernel fits too).
    The result is packed like ``q``, in the dtype ``attend`` returns (the reference returns
    ``q``'s dtype: pass a float64 ``q`` for a float64 oracle).
    """
    starts, q_lens, lengths_k = check_packing(cu_seqlens_q, seq_lens_k, q.shape[0])
    offsets = row_offsets(q_offsets, q_lens, lengths_k)
    if len(row_segments) != len(lengths_k):
        raise ValueError(
            f"row_segments has {len(row_segments)} rows, expected batch = {len(lengths_k)}"
        )
    for row, segs in enumerate(row_segments):
        check_segments_cover(
            segs, q_offset=offsets[row], q_len=q_lens[row], seq_len=lengths_k[row], row=row
        )
    # Each call is a list of (row, segment) pairs; each pair is one packed row of that call.
    if batch_rows:
        patterns = {row: [seg.causal for seg in segs] for row, segs in enumerate(row_segments)}
        busy = [row for row, segs in enumerate(row_segments) if segs]
        for row in busy:
            if patterns[row] != patterns[busy[0]]:
                raise ValueError(
                    "batch_rows needs rows whose segments line up (same count, causal in the "
                    f"same places): row {busy[0]} has causal pattern {patterns[busy[0]]}, "
                    f"row {row} has {patterns[row]}"
                )
        count = len(row_segments[busy[0]]) if busy else 0
        calls = [[(row, row_segments[row][s]) for row in busy] for s in range(count)]
    else:
        calls = [[(row, seg)] for row, segs in enumerate(row_segments) for seg in segs]

    result = None
    for call in calls:
        q_ranges = [
            (starts[row] + seg.start - offsets[row], starts[row] + seg.end - offsets[row])
            for row, seg in call
        ]
        sizes = [hi - lo for lo, hi in q_ranges]
        sub_out = attend(
            torch.cat([q[lo:hi] for lo, hi in q_ranges]),
            k_cache,
            v_cache,
            block_table[torch.tensor([row for row, _ in call], device=block_table.device)],
            torch.tensor([0, *accumulate(sizes)], dtype=torch.int32, device=q.device),
            torch.tensor([seg.key_end for _, seg in call], dtype=torch.int32, device=q.device),
            max_seqlen_q=max(sizes),
            softmax_scale=softmax_scale,
            causal=call[0][1].causal,
        )
        if result is None:
            result = torch.full(q.shape, float("nan"), dtype=sub_out.dtype, device=q.device)
        for (lo, hi), part in zip(q_ranges, sub_out.split(sizes), strict=True):
            result[lo:hi] = part
    return torch.empty_like(q) if result is None else result


def mixed_mask_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens_k: Tensor,
    *,
    spans: Sequence,
    q_offsets: Sequence[int] | Tensor | None = None,
    softmax_scale: float | None = None,
    attend: AttentionFn = paged_attention,
) -> Tensor:
    """The oracle for ``kernels.masks.mixed_mask_attention``: build segments, one call each.

    Rows whose segments line up share their calls (one per segment); otherwise each row's
    segments are called separately. ``spans`` is one list of ``(start, end)`` pairs shared by all
    rows, or one list per row.
    """
    row_segments = segments_for_batch(spans, cu_seqlens_q, seq_lens_k, q_offsets=q_offsets)
    return per_segment_attention(
        q,
        k_cache,
        v_cache,
        block_table,
        cu_seqlens_q,
        seq_lens_k,
        row_segments=row_segments,
        q_offsets=q_offsets,
        softmax_scale=softmax_scale,
        batch_rows=segments_line_up(row_segments),
        attend=attend,
    )
