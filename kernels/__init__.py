"""Triton kernels for paged attention over a video-diffusion KV cache. No paging knowledge.

Importing this package switches Triton's interpreter on when no GPU is visible and
``TRITON_INTERPRET`` is unset: the variable is read when kernels are decorated.
``backend(device)`` says which path the kernels take: "triton", "interpreter" or "torch".
"""

if __name__ != "paged_video.kernels":  # a bare `import kernels` found this clone's folder
    from paged_video._clone import hand_over

    hand_over(__name__, __file__)
else:
    from paged_video.kernels._runtime import backend, enable_interpreter_if_no_gpu

    enable_interpreter_if_no_gpu()

    from paged_video.kernels.gather_blocks import gather_blocks
    from paged_video.kernels.masks import key_limits_from_spans, mixed_mask_attention
    from paged_video.kernels.merge_states import (
        merge_attention_states,
        merge_stacked_attention_states,
    )
    from paged_video.kernels.paged_attention import (
        call_tiles,
        choose_tiles,
        paged_attention,
    )
    from paged_video.kernels.pool_layout import keys_major
    from paged_video.kernels.write_slots import write_slots

__all__ = [
    "backend",
    "call_tiles",
    "choose_tiles",
    "gather_blocks",
    "key_limits_from_spans",
    "keys_major",
    "merge_attention_states",
    "merge_stacked_attention_states",
    "mixed_mask_attention",
    "paged_attention",
    "write_slots",
]
