"""Triton kernels for paged attention over a video-diffusion KV cache. No paging knowledge.

Importing this package switches Triton's interpreter on when no GPU is visible and
``TRITON_INTERPRET`` is unset: the variable is read when kernels are decorated.
"""

from paged_video.kernels._runtime import enable_interpreter_if_no_gpu

enable_interpreter_if_no_gpu()

from paged_video.kernels.gather_blocks import gather_blocks  # noqa: E402
from paged_video.kernels.masks import key_limits_from_spans, mixed_mask_attention  # noqa: E402
from paged_video.kernels.merge_states import (  # noqa: E402
    merge_attention_states,
    merge_stacked_attention_states,
)
from paged_video.kernels.paged_attention import choose_tiles, paged_attention  # noqa: E402
from paged_video.kernels.write_slots import write_slots  # noqa: E402

__all__ = [
    "choose_tiles",
    "gather_blocks",
    "key_limits_from_spans",
    "merge_attention_states",
    "merge_stacked_attention_states",
    "mixed_mask_attention",
    "paged_attention",
    "write_slots",
]

if __name__ != "paged_video.kernels":  # a bare `import kernels` from a clone's root
    raise ImportError("this folder is paged_video.kernels; import it by that name")
