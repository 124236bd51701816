"""Float64 oracle of merging partial attentions by their log-sum-exp."""

from __future__ import annotations

import torch
from torch import Tensor


def merge_attention_states(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` in float64 of ``n`` parts ``outs (n, T, H, D)`` with ``lses (n, T, H)``.

    ``out = sum_i w_i o_i / sum_i w_i`` with ``w_i = exp(lse_i - max_j lse_j)`` and
    ``lse = log(sum_i exp(lse_i))``; a part with ``lse_i = -inf`` contributes nothing (its
    output is ignored, NaN included); a row no part saw gives zeros and ``-inf``.
    """
    lse64 = lses.to(torch.float64)
    merged = torch.logsumexp(lse64, dim=0)  # -inf where every part is -inf (or n is 0)
    weights = torch.exp(lse64 - torch.where(merged == float("-inf"), 0.0, merged))
    seen = (lse64 > float("-inf")).unsqueeze(-1)
    terms = torch.where(seen, outs.to(torch.float64) * weights.unsqueeze(-1), 0.0)
    return terms.sum(dim=0), merged
