"""Choosing the paging block size for a frame size and the sizes a kernel accepts."""

from __future__ import annotations

from collections.abc import Iterable

from paged_video.paging._validate import require_int


def paging_block_size(tokens_per_frame: int, supported: Iterable[int] | None = None) -> int:
    """The frame itself where it is a legal block size, else the finest (smallest) legal size.

    ``supported`` lists the legal sizes (``range(16, 4097, 16)`` for FlashAttention's paged
    kernels); ``None`` means any size, as this project's kernels take, and picks the frame.
    One block per frame makes chunks and blocks line up; otherwise fine blocks waste the least
    at the window's two boundaries. Which is faster is for the benchmark to answer.
    """
    require_int("tokens_per_frame", tokens_per_frame, minimum=1)
    if supported is None:
        return tokens_per_frame
    sizes = set()
    for size in supported:
        sizes.add(require_int("supported", size, minimum=1))
    if not sizes:
        raise ValueError("supported must list at least one block size")
    return tokens_per_frame if tokens_per_frame in sizes else min(sizes)
