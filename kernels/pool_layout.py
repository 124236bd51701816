"""How a pool's elements lie in memory: code pools ``(block, slot, KV head, channel)`` and scale
pools ``(block, slot, KV head)``.

Every kernel takes pools by their strides, so the layout is the caller's choice:

* **slot-major** (``torch.empty(blocks, block_size, kv_heads[, head_dim])``): a slot's heads
  (and channels) are contiguous. What the cache allocates, and what the TMA loops' descriptors
  read.
* **keys-major** (``keys_major(pool)``: memory ordered ``(block, KV head[, channel], slot)``):
  the keys of a block are contiguous for each head (and channel), as vLLM lays out its V cache.
  The 8-bit MMA reads ``P V`` with the keys (its reduction axis) contiguous, so over a
  keys-major e4m3 V pool the k8v8 format feeds V's tile to the MMA as it was prefetched, where
  a slot-major one is transposed through shared memory every tile. Keys-major scale pools let
  Triton 3.6 prefetch a tile's scales two at a time (it copies each thread's own columns).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Keys per padded row of a keys-major pool: 16 one-byte codes, one ``cp.async`` vector.
KEY_ALIGNMENT = 16


def keys_major(pool: Tensor) -> Tensor:
    """A copy of ``pool`` (4-D codes ``(blocks, block_size, kv_heads, head_dim)`` or 3-D scales
    ``(blocks, block_size, kv_heads)``), same shape and values, stored keys-major.

    Each row of a block's keys is padded to a multiple of ``KEY_ALIGNMENT`` elements, so that
    every row starts aligned: ``cp.async`` copies 16 bytes at a time only from 16-byte aligned
    addresses, and Triton loads a tile whose rows it cannot prove aligned synchronously (blocks 24,
    520, 1560 unpadded: 33-36 plain loads per iteration of the (since deleted) FP8-MMA hot loop,
    against none padded). The padding is never read. Blocks of one slot are not padded
    (``padded_keys``)."""
    if not isinstance(pool, Tensor):
        raise TypeError(f"pool must be a torch.Tensor, got {type(pool).__name__}")
    if pool.dim() not in (3, 4):
        raise ValueError(
            "pool must be 4-D (blocks, block_size, kv_heads, head_dim) or 3-D (blocks, "
            f"block_size, kv_heads), got shape {tuple(pool.shape)}"
        )
    view = empty_keys_major(*pool.shape, dtype=pool.dtype, device=pool.device)
    view.copy_(pool)
    return view


def empty_keys_major(
    blocks: int,
    block_size: int,
    *rest: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> Tensor:
    """An uninitialized keys-major pool of shape ``(blocks, block_size, *rest)`` (``rest``:
    KV heads, and head_dim for codes), laid out as ``keys_major`` lays out its copies."""
    row = padded_keys(block_size)
    storage = torch.empty(blocks, *rest, row, dtype=dtype, device=device)
    last = len(rest) + 1
    return storage[..., :block_size].permute(0, last, *range(1, last))


def padded_keys(block_size: int) -> int:
    """Elements per row of a block's keys in a keys-major pool: ``block_size`` rounded up to
    ``KEY_ALIGNMENT``, except a block of one slot. Its rows are one key each: the pool is then
    laid out as a slot-major one (``is_keys_major`` counts it so), and padding would store 16
    times the pool to no end (the kernels read it as slot-major; padded, they gathered an e4m3
    V a byte at a time, and the loop spilled on Triton 3.6)."""
    return 1 if block_size == 1 else -(-block_size // KEY_ALIGNMENT) * KEY_ALIGNMENT


def keys_aligned(pool: Tensor | None) -> bool:
    """True when ``pool`` is keys-major and every row of a block's keys starts
    ``KEY_ALIGNMENT`` elements aligned (as ``keys_major`` makes it): what the kernels need to
    prefetch such rows 16 bytes at a time, and what they then tell Triton."""
    if pool is None or not is_keys_major(pool):
        return False
    strides = [stride for dim, stride in enumerate(pool.stride()) if dim != 1]
    aligned_start = pool.data_ptr() % (KEY_ALIGNMENT * pool.element_size()) == 0
    return aligned_start and all(stride % KEY_ALIGNMENT == 0 for stride in strides)


def is_keys_major(pool: Tensor) -> bool:
    """True when each block's keys are contiguous for every KV head (and channel); a block of
    one slot counts as slot-major: its one key has no neighbour."""
    return pool.dim() in (3, 4) and pool.shape[1] > 1 and pool.stride(1) == 1
