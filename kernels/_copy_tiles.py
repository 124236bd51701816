"""Launch geometry shared by the copy kernels (``write_slots``, ``gather_blocks``).

A program copies a ``[block_t, block_c]`` tile of K and of V: ``block_t`` token rows, and
``block_c`` elements of each row's (head, dim) plane. When all four tensors store that plane as
one contiguous run (*flat*), the plane is a row of ``heads * head_dim`` elements and the chunk is
the power of two that pads it least (5120 = 40 x 128 takes 1024, five chunks, no idle lane), so
every load is a full 16-byte vector. Otherwise (*strided*) a chunk is ``block_h`` whole heads
(the power of two that pads least), each padded to a power of two. On a GPU a tile holds 4096
elements: for bf16 and 4 warps, each thread issues four 16-byte loads of K and four of V before
its first store. Under the interpreter a tile is as big as possible, since a program costs a few
numpy calls whatever its size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton
import triton.language as tl
from torch import Tensor

from paged_video.kernels._runtime import interpreter_active

# Elements per tensor per program, and the widest column chunk, on a GPU.
GPU_TILE = 1 << 12
GPU_CHUNK = 1 << 10
# Under the interpreter: one program per tensor-sized tile.
INTERPRETER_TILE = 1 << 16
# The narrowest flat chunk considered (16 elements: one 32-byte sector of bf16).
MIN_CHUNK = 16


@dataclass(frozen=True)
class CopyTiles:
    """Tile of one copy program: ``block_t`` rows x ``block_c`` plane elements."""

    block_t: int
    block_c: int
    block_d: int
    flat: bool
    col_programs: int

    def grid(self, num_rows: int) -> tuple[int, int]:
        """The launch grid: row programs by column programs."""
        return -(-num_rows // self.block_t), self.col_programs

    def constexprs(self) -> dict[str, object]:
        """The kernels' tile constexprs."""
        return {
            "BLOCK_T": self.block_t,
            "BLOCK_C": self.block_c,
            "BLOCK_D": self.block_d,
            "FLAT": self.flat,
        }


def plane_is_flat(tensor: Tensor) -> bool:
    """Whether each row's trailing (head, dim) plane is one contiguous run of elements."""
    heads, dim = tensor.shape[-2:]
    stride_head, stride_dim = tensor.stride()[-2:]
    return (dim == 1 or stride_dim == 1) and (heads == 1 or stride_head == dim)


def _chunk(count: int, smallest: int, widest: int, interpreted: bool) -> int:
    """The power of two in ``smallest..widest`` that pads ``count`` least; the widest on ties.

    Under the interpreter fewer, bigger programs beat idle lanes: one padded chunk if it fits.
    """
    if interpreted:
        return min(triton.next_power_of_2(count), widest)
    candidates = []
    size = min(smallest, triton.next_power_of_2(count))
    while size <= widest:
        candidates.append(size)
        size *= 2
    return min(candidates, key=lambda c: (triton.cdiv(count, c) * c - count, -c))


def copy_tiles(num_rows: int, num_kv_heads: int, head_dim: int, flat: bool) -> CopyTiles:
    """The tile for copying ``num_rows`` rows of ``(num_kv_heads, head_dim)`` planes.

    Memoized: a copy call's host time adds to a kernel of tens of microseconds (a write of one
    forward's K/V at the shipped geometry copies 96 MB, 50 us on an H200), and the same shapes
    come back every forward."""
    return _copy_tiles(num_rows, num_kv_heads, head_dim, flat, interpreter_active())


@functools.lru_cache(maxsize=1024)
def _copy_tiles(
    num_rows: int, num_kv_heads: int, head_dim: int, flat: bool, interpreted: bool
) -> CopyTiles:
    budget = INTERPRETER_TILE if interpreted else GPU_TILE
    block_d = triton.next_power_of_2(head_dim)
    if flat:
        row = num_kv_heads * head_dim
        block_c = _chunk(row, MIN_CHUNK, budget if interpreted else GPU_CHUNK, interpreted)
        col_programs = triton.cdiv(row, block_c)
    else:
        block_h = _chunk(num_kv_heads, 1, max(1, budget // block_d), interpreted)
        block_c = block_h * block_d
        col_programs = triton.cdiv(num_kv_heads, block_h)
    block_t = max(1, min(triton.next_power_of_2(max(num_rows, 1)), budget // block_c))
    return CopyTiles(block_t, block_c, block_d, flat, col_programs)


@triton.jit
def plane_mask(
    chunk, num_kv_heads, head_dim, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, FLAT: tl.constexpr
):
    """Which lanes of plane chunk ``chunk`` hold a real (head, dim) element."""
    idx = tl.arange(0, BLOCK_C)
    if FLAT:
        real = chunk * BLOCK_C + idx < num_kv_heads * head_dim
    else:
        real = (chunk * (BLOCK_C // BLOCK_D) + idx // BLOCK_D < num_kv_heads) & (
            idx % BLOCK_D < head_dim
        )
    return real


@triton.jit
def plane_offsets(
    chunk, stride_head, stride_dim, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, FLAT: tl.constexpr
):
    """Element offsets of plane chunk ``chunk`` within one row of a tensor with these strides."""
    idx = tl.arange(0, BLOCK_C)
    if FLAT:
        offsets = (chunk * BLOCK_C + idx).to(tl.int64)
    else:
        head = (chunk * (BLOCK_C // BLOCK_D) + idx // BLOCK_D).to(tl.int64)
        offsets = head * stride_head + (idx % BLOCK_D).to(tl.int64) * stride_dim
    return offsets
