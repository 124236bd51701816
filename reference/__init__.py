"""Pure-PyTorch float64 oracles. Imports nothing else of this project."""

from reference.attention import attention_mask, dense_attention, paged_attention
from reference.masks import MaskSegment, mask_segments, mixed_mask_attention, per_segment_attention
from reference.window import (
    SlotLedger,
    WindowGeometry,
    block_read_positions,
    kept_positions,
    resident_positions,
    slots_read,
)

__all__ = [
    "MaskSegment",
    "SlotLedger",
    "WindowGeometry",
    "attention_mask",
    "block_read_positions",
    "dense_attention",
    "kept_positions",
    "mask_segments",
    "mixed_mask_attention",
    "paged_attention",
    "per_segment_attention",
    "resident_positions",
    "slots_read",
]
