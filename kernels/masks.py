"""Mixed causal / full attention masks in one launch of ``paged_attention``.

Positions are global: key ``j`` of a row is position ``j`` (keys start at 0) and the row's
queries sit at ``q_offset .. q_offset + q_len - 1`` (default ``q_offset = k_len - q_len``:
FlashAttention's bottom-right alignment). A full span ``[a, b)`` (half-open) is bidirectional: a
query at position ``p`` with ``a <= p < b`` sees keys ``[0, b)``, even keys past the end of its
own query shard. Every other query sees keys ``[0, p]`` (causal).

That mask is one exclusive key limit per query (``b`` inside a span, ``p + 1`` elsewhere), built
here with vectorised torch ops and handed to the kernel as ``key_limits`` with ``causal=False``.
Because every query carries its own limit, the rows of a packed batch need not line up: any mix
of spans, offsets and lengths runs in the same single launch, and nothing falls back to one call
per segment (``reference.masks`` is that per-segment oracle).

The limits depend only on the spans and the lengths, not on the layer: build them once per
forward with :func:`key_limits_from_spans` and pass them to ``paged_attention(key_limits=...)``
in every layer. Building them reads ``cu_seqlens_q``, ``seq_lens_k`` and ``q_offsets`` on the
host (one device sync) to validate the spans.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import pairwise

import torch
from torch import Tensor

from paged_video.kernels import _checks
from paged_video.kernels.paged_attention import paged_attention

Span = tuple[int, int]
# One list of spans shared by every row, or one list per row.
Spans = Sequence[Span] | Sequence[Sequence[Span]]


def _is_per_row(spans: Sequence) -> bool:
    """Per-row form: a non-empty list whose every entry is a list of pairs (or empty)."""
    return len(spans) > 0 and all(
        isinstance(entry, Sequence) and all(isinstance(pair, Sequence) for pair in entry)
        for entry in spans
    )


def _checked_spans(name: str, spans: Sequence, seq_len: int) -> list[Span]:
    """``spans`` as int pairs; raises unless each is non-empty, sorted, disjoint, in the row."""
    checked: list[Span] = []
    for index, span in enumerate(spans):
        try:
            start, end = (operator.index(bound) for bound in span)
        except (TypeError, ValueError):
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
                f"{name}[{index}] = [{start}, {end}) begins before the previous span ends "
                f"({checked[-1][1]}): spans must be sorted and must not overlap"
            )
        checked.append((start, end))
    return checked


def _spans_per_row(spans: Spans, seq_lens: list[int]) -> list[list[Span]]:
    """Validated spans for each row; shared spans must fit inside every row."""
    if isinstance(spans, (str, bytes, Tensor)) or not isinstance(spans, Sequence):
        raise TypeError(
            "spans must be a list of (start, end) pairs, or one such list per row; "
            f"got {type(spans).__name__}"
        )
    batch = len(seq_lens)
    if not _is_per_row(spans):
        return [
            _checked_spans(f"spans (shared; row {row})", spans, seq_len)
            for row, seq_len in enumerate(seq_lens)
        ]
    if len(spans) != batch:
        raise ValueError(f"spans has {len(spans)} rows, expected one per row (batch = {batch})")
    return [
        _checked_spans(f"spans[{row}]", row_spans, seq_len)
        for row, (row_spans, seq_len) in enumerate(zip(spans, seq_lens, strict=True))
    ]


def _query_offsets(
    q_offsets: Sequence[int] | Tensor | None, q_lens: list[int], k_lens: list[int]
) -> list[int]:
    """Each row's first query position; raises unless every query is a position of its row."""
    if q_offsets is None:
        offsets = [k_len - q_len for q_len, k_len in zip(q_lens, k_lens, strict=True)]
    elif isinstance(q_offsets, Tensor):
        _checks.check_rank("q_offsets", q_offsets, 1, "(batch,)")
        _checks.check_dtype("q_offsets", q_offsets, _checks.INDEX_DTYPES)
        offsets = q_offsets.tolist()
    else:
        offsets = [operator.index(offset) for offset in q_offsets]
    if len(offsets) != len(q_lens):
        raise ValueError(f"q_offsets must have shape ({len(q_lens)},), got {len(offsets)} entries")
    for row, (offset, q_len, k_len) in enumerate(zip(offsets, q_lens, k_lens, strict=True)):
        if not 0 <= offset <= k_len - q_len:
            raise ValueError(
                f"row {row}: queries [{offset}, {offset + q_len}) must lie inside the row's "
                f"keys [0, {k_len}): need 0 <= q_offsets[{row}] <= seq_lens_k - q_len"
            )
    return offsets


def key_limits_from_spans(
    spans: Spans,
    cu_seqlens_q: Tensor,
    seq_lens_k: Tensor,
    *,
    q_offsets: Sequence[int] | Tensor | None = None,
) -> Tensor:
    """Per-query exclusive key limits, int32 ``(total_q,)``, expressing the mixed mask.

    ``spans``: full spans ``(start, end)`` in global positions, sorted and disjoint, either one
    list shared by every row or one list per row (``[[(0, 4)], []]``). ``q_offsets`` (``(batch,)``)
    is each row's first query position, by default ``seq_lens_k - q_len``. A query at ``p``
    inside span ``[a, b)`` gets ``b``; any other gets ``p + 1``.
    """
    _checks.check_rank("cu_seqlens_q", cu_seqlens_q, 1, "(batch + 1,)")
    _checks.check_rank("seq_lens_k", seq_lens_k, 1, "(batch,)")
    _checks.check_dtype("cu_seqlens_q", cu_seqlens_q, (torch.int32,))
    _checks.check_dtype("seq_lens_k", seq_lens_k, (torch.int32,))
    device = _checks.check_same_device(cu_seqlens_q=cu_seqlens_q, seq_lens_k=seq_lens_k)
    starts, k_lens = cu_seqlens_q.tolist(), seq_lens_k.tolist()
    if len(starts) != len(k_lens) + 1:
        raise ValueError(
            f"cu_seqlens_q must have shape ({len(k_lens) + 1},) for seq_lens_k of "
            f"{len(k_lens)} rows, got {tuple(cu_seqlens_q.shape)}"
        )
    if any(k_len < 0 for k_len in k_lens):
        raise ValueError(f"seq_lens_k must be >= 0, got {k_lens}")
    q_lens = [end - start for start, end in pairwise(starts)]
    if starts[0] != 0 or any(q_len < 0 for q_len in q_lens):
        raise ValueError(
            f"cu_seqlens_q must start at 0 and never decrease, so the rows cover the packed "
            f"queries contiguously; got {starts}"
        )
    offsets = _query_offsets(q_offsets, q_lens, k_lens)
    spans_by_row = _spans_per_row(spans, k_lens)

    # Every row's spans in one sorted list, row r's shifted by r * stride (stride exceeds every
    # position), behind a sentinel [-1, -1) that keeps every index valid. One searchsorted then
    # finds each query's last span starting at or before it; the query is inside that span iff
    # it is also before the span's end (a span of an earlier row ends before row r's keys begin).
    stride = max(k_lens, default=0) + 1
    flat = [(-1, -1)] + [
        (row * stride + start, row * stride + end)
        for row, row_spans in enumerate(spans_by_row)
        for start, end in row_spans
    ]
    flat_start = torch.tensor([start for start, _ in flat], dtype=torch.int64, device=device)
    flat_end = torch.tensor([end for _, end in flat], dtype=torch.int64, device=device)

    total_q = starts[-1]
    row_of_query = torch.repeat_interleave(
        torch.arange(len(q_lens), device=device),
        torch.tensor(q_lens, device=device),
        output_size=total_q,
    )
    first_query = cu_seqlens_q.to(torch.int64)[row_of_query]
    row_offset = torch.tensor(offsets, dtype=torch.int64, device=device)[row_of_query]
    position = torch.arange(total_q, device=device) - first_query + row_offset
    shifted = row_of_query * stride + position
    span_end = flat_end[torch.searchsorted(flat_start, shifted, right=True) - 1]
    limits = torch.where(shifted < span_end, span_end - row_of_query * stride, position + 1)
    return limits.to(torch.int32)


def mixed_mask_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens_k: Tensor,
    *,
    spans: Spans,
    max_seqlen_q: int,
    q_offsets: Sequence[int] | Tensor | None = None,
    softmax_scale: float | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Paged attention under the mixed causal / full mask, one kernel launch for the batch.

    Arguments as :func:`kernels.paged_attention` (which validates the tensors), plus ``spans``
    and ``q_offsets`` as in :func:`key_limits_from_spans`.
    """
    _checks.check_rank("q", q, 3, "(total_q, num_heads, head_dim)")
    _checks.check_rank("cu_seqlens_q", cu_seqlens_q, 1, "(batch + 1,)")
    if cu_seqlens_q.numel() and int(cu_seqlens_q[-1]) != q.shape[0]:
        raise ValueError(
            f"cu_seqlens_q must end at total_q = {q.shape[0]} (q's first dimension), "
            f"got {cu_seqlens_q.tolist()}"
        )
    key_limits = key_limits_from_spans(spans, cu_seqlens_q, seq_lens_k, q_offsets=q_offsets)
    return paged_attention(
        q,
        k_cache,
        v_cache,
        block_table,
        cu_seqlens_q,
        seq_lens_k,
        max_seqlen_q=max_seqlen_q,
        softmax_scale=softmax_scale,
        causal=False,
        out=out,
        key_limits=key_limits,
    )
