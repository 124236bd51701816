"""History staging: per-layer contiguous K/V copies of the visible window, and what they hold.

A forward that keeps the same history as the forward staged before it only restages its own
chunk's blocks (``gather_blocks(..., first_block=...)``); anything else restages the window.

The record of what each layer's buffers hold is ``tags``: one history id per layer, written by
the fused op (``kernels.fused``), the code that writes the buffers, and only once that layer's
restage is done; every other use of the op (a batched forward attending over the paged cache)
sets it to ``NOTHING_STAGED``. Preparing, dropping or batching a plan never changes it, so a
plan that does not run cannot leave a record of buffers nothing filled.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

NOTHING_STAGED = -1
# Interned history ids kept at most before the ones no layer holds are dropped (an id is never
# reused, so dropping one only costs a full restage of a plan prepared before the drop).
_MAX_IDS = 64


@dataclass(frozen=True)
class StagingDecision:
    """How a one-row forward restages its ``num_blocks`` visible blocks.

    ``key`` names the visible history (session, branch, history blocks, lengths). A layer whose
    buffers hold ``key`` restages from ``first_block`` (the history blocks that may be kept,
    0 when nothing may be: action tokens, a chunk that is not block-aligned); any other layer
    restages everything.
    """

    key: int
    first_block: int
    num_blocks: int


class HistoryStaging:
    """Stacked K and V staging buffers, ``(num_layers, tokens, num_kv_heads, head_dim)``.

    Allocated once with static addresses (for CUDA graphs). ``tags`` (int64, CPU,
    ``(num_layers,)``) is each layer's staged history id, ``NOTHING_STAGED`` when nothing in
    its buffers may be reused. With ``scales`` (quantized caches: ``dtype`` is the codes'),
    ``k_scales``/``v_scales`` ``(num_layers, tokens, num_kv_heads)`` float32 hold the staged
    tokens' scales; otherwise they are zero-size. ``v_dtype`` (default ``dtype``) is V's
    buffer's: k8v8's e4m3 codes or k8v16's values beside int8 K codes, whose V has no scale
    per token (``v_scales=False``: ``v_scales`` zero-size).
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
        scales: bool = False,
        v_dtype: torch.dtype | None = None,
        v_scales: bool | None = None,
    ) -> None:
        shape = (num_layers, tokens, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype if v_dtype is None else v_dtype, device=device)
        scale_shape = shape[:-1] if scales else (0,)
        v_scale_shape = scale_shape if v_scales is None or v_scales else (0,)
        self.k_scales = torch.empty(scale_shape, dtype=torch.float32, device=device)
        self.v_scales = torch.empty(v_scale_shape, dtype=torch.float32, device=device)
        from torch._dynamo import mark_static_address  # heavy; only staging caches pay for it

        for buffer in (self.k, self.v, self.k_scales, self.v_scales):
            mark_static_address(buffer)
        self.tags = torch.full((num_layers,), NOTHING_STAGED, dtype=torch.int64)
        self._ids: dict[Hashable, int] = {}
        self._next_id = 0

    def key_id(self, key: Hashable) -> int:
        """The id of the history ``key`` names; a new id for a key not seen (or dropped)."""
        if key not in self._ids:
            if len(self._ids) >= _MAX_IDS:
                held = set(self.tags.tolist())
                self._ids = {k: i for k, i in self._ids.items() if i in held}
            self._ids[key] = self._next_id
            self._next_id += 1
        return self._ids[key]

    def decide(
        self, key: Hashable, *, reusable: bool, history_blocks: int, num_blocks: int
    ) -> StagingDecision:
        """The decision for a forward whose visible history is ``key``; records nothing."""
        return StagingDecision(
            key=self.key_id(key),
            first_block=history_blocks if reusable else 0,
            num_blocks=num_blocks,
        )

    def first_block(self, decision: StagingDecision) -> int:
        """Where a forward of ``decision`` would restage from if every layer ran now."""
        held = self.tags.eq(decision.key).all().item()
        return decision.first_block if held else 0

    def forget(self, key: int) -> None:
        """The plan of history ``key`` was cancelled: nothing may reuse what it staged."""
        self.tags.masked_fill_(self.tags.eq(key), NOTHING_STAGED)
