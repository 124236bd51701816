"""History staging: per-layer contiguous K/V copies of the visible window, and when to reuse them.

A forward that keeps the same history as the forward staged before it only restages its own
chunk's blocks (``gather_blocks(..., first_block=...)``); anything else restages the window.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StagingDecision:
    """Restage the row's visible blocks ``first_block .. num_blocks - 1``; 0 restages all."""

    first_block: int
    num_blocks: int


class HistoryStaging:
    """Stacked K and V staging buffers, ``(num_layers, tokens, num_kv_heads, head_dim)``.

    Allocated once with static addresses (for CUDA graphs). ``decide`` compares a forward's
    staging key (session, branch, visible history blocks, lengths) with the key staged last and
    records the new one.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        tokens: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, tokens, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        from torch._dynamo import mark_static_address  # heavy; only staging caches pay for it

        mark_static_address(self.k)
        mark_static_address(self.v)
        self._staged: Hashable | None = None

    def decide(
        self, key: Hashable, *, reusable: bool, history_blocks: int, num_blocks: int
    ) -> StagingDecision:
        """Keep the staged history when ``reusable`` and ``key`` is what is staged now."""
        keep = reusable and key == self._staged
        self._staged = key
        return StagingDecision(first_block=history_blocks if keep else 0, num_blocks=num_blocks)

    def forget(self, key: Hashable) -> None:
        """The forward staged under ``key`` will not run: nothing may reuse its staging."""
        if self._staged == key:
            self._staged = None
