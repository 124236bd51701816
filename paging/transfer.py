"""One asynchronous host-to-device copy for a forward's small integer tensors.

``ForwardPlan.prepare`` builds half a dozen small tensors (slots, block table, lengths) on the
host. Moved one by one with ``.to(device)`` from pageable memory, each is a synchronous copy that
waits behind every kernel already queued. ``to_device`` packs them into one host buffer (pinned
when the target is CUDA), moves it with one ``non_blocking`` copy, and hands out views into the
one device buffer, so preparing the next forward never waits for the GPU. The pinned buffer is
the caching host allocator's: it is not reused before the copy that reads it has finished.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

# Every view starts on a 16-byte boundary: aligned for any dtype, and for Triton's pointer
# specialisation.
ALIGN = 16


def byte_offsets(tensors: Sequence[Tensor]) -> tuple[list[int], int]:
    """Each tensor's byte offset in the packed buffer, and the buffer's size in bytes."""
    offsets, end = [], 0
    for tensor in tensors:
        end = -(-end // ALIGN) * ALIGN
        offsets.append(end)
        end += tensor.numel() * tensor.element_size()
    return offsets, end


def _views(buffer: Tensor, tensors: Sequence[Tensor], offsets: list[int]) -> list[Tensor]:
    """Views into the byte ``buffer`` with each tensor's dtype and shape, at its offset."""
    return [
        buffer[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        for t, offset in zip(tensors, offsets, strict=True)
    ]


def pack(tensors: Sequence[Tensor], *, pin: bool) -> tuple[Tensor, list[int]]:
    """Copy host ``tensors`` into one new byte buffer (page-locked if ``pin``); and the offsets."""
    for i, tensor in enumerate(tensors):
        if tensor.device.type != "cpu":
            raise ValueError(f"tensors[{i}] must be on the host, got {tensor.device}")
    offsets, size = byte_offsets(tensors)
    buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
    for view, tensor in zip(_views(buffer, tensors, offsets), tensors, strict=True):
        view.copy_(tensor)
    return buffer, offsets


def to_device(tensors: Sequence[Tensor], device: torch.device) -> list[Tensor]:
    """The host ``tensors`` on ``device`` (same values, dtypes, shapes), moved by one copy.

    The results are contiguous views into one buffer; on a CPU, into the packed host buffer.
    """
    device = torch.device(device)
    buffer, offsets = pack(tensors, pin=device.type == "cuda")
    return _views(buffer.to(device, non_blocking=True), tensors, offsets)
