"""Pure-PyTorch float64 oracles. Imports nothing else of this project."""

if __name__ != "paged_video.reference":  # a bare `import reference` found this clone's folder
    from paged_video._clone import hand_over

    hand_over(__name__, __file__)
else:
    from paged_video.reference import quantize, quantized_attention, regrow
    from paged_video.reference.attention import attention_mask, dense_attention, paged_attention
    from paged_video.reference.masks import (
        MaskSegment,
        mask_segments,
        mixed_mask_attention,
        per_segment_attention,
    )
    from paged_video.reference.merge import merge_attention_states
    from paged_video.reference.window import (
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
    "merge_attention_states",
    "mixed_mask_attention",
    "paged_attention",
    "per_segment_attention",
    "quantize",
    "quantized_attention",
    "regrow",
    "resident_positions",
    "slots_read",
]
