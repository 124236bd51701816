"""Triton kernels for paged attention over a video-diffusion KV cache. No paging knowledge.

Importing this package switches Triton's interpreter on when no GPU is visible and
``TRITON_INTERPRET`` is unset: the variable is read when kernels are decorated.
"""

from kernels._runtime import enable_interpreter_if_no_gpu

enable_interpreter_if_no_gpu()

from kernels.gather_blocks import gather_blocks  # noqa: E402
from kernels.masks import key_limits_from_spans, mixed_mask_attention  # noqa: E402
from kernels.paged_attention import choose_tiles, paged_attention  # noqa: E402
from kernels.write_slots import write_slots  # noqa: E402

__all__ = [
    "choose_tiles",
    "gather_blocks",
    "key_limits_from_spans",
    "mixed_mask_attention",
    "paged_attention",
    "write_slots",
]
