"""Batching plans: several sequences' forwards as one set of attention tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paged_video.paging.plan import AttentionInputs, ForwardPlan


def batch_plans(plans: Sequence[ForwardPlan]) -> AttentionInputs:
    """Stack prepared plans of one cache (several sessions, or both CFG branches) row by row.

    Block-table rows keep the cache's fixed width; ``cu_seqlens_q`` is re-accumulated and the
    video and action slots, ``seq_lens_k`` and ``key_gap`` are concatenated in the order given,
    which is the order of the packed queries (and of the packed video and action K/V). Each
    sequence may appear once: rows of one batch must not share scratch blocks or pending tails.
    """
    if isinstance(plans, ForwardPlan) or not isinstance(plans, Sequence) or not plans:
        raise TypeError("plans must be a non-empty sequence of ForwardPlan")
    seen: set[tuple[int, str]] = set()
    for i, plan in enumerate(plans):
        if not isinstance(plan, ForwardPlan):
            raise TypeError(f"plans[{i}] must be a ForwardPlan, got {type(plan).__name__}")
        plan.check_current(f"plans[{i}]")  # prepared, and its blocks still its own
        if plan.cache is not plans[0].cache:
            raise ValueError(f"plans[{i}] belongs to another cache than plans[0]")
        key = (plan.session.id, plan.branch)
        if key in seen:
            raise ValueError(
                f"plans[{i}]: session {key[0]} branch {key[1]!r} appears twice in the batch"
            )
        seen.add(key)
    rows = [plan.inputs for plan in plans]
    query_lens = torch.cat([row.cu_seqlens_q[1:] - row.cu_seqlens_q[:-1] for row in rows])
    cu_seqlens_q = torch.zeros(len(rows) + 1, dtype=torch.int32, device=query_lens.device)
    cu_seqlens_q[1:] = torch.cumsum(query_lens, 0)
    return AttentionInputs(
        video_slots=torch.cat([row.video_slots for row in rows]),
        action_slots=torch.cat([row.action_slots for row in rows]),
        block_table=torch.cat([row.block_table for row in rows]),
        cu_seqlens_q=cu_seqlens_q,
        seq_lens_k=torch.cat([row.seq_lens_k for row in rows]),
        key_gap=torch.cat([row.key_gap for row in rows]),
        max_seqlen_q=max(row.max_seqlen_q for row in rows),
        max_seqlen_k=rows[0].max_seqlen_k,
        exact_window=rows[0].exact_window,
    )
