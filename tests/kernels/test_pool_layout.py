"""kernels.pool_layout: keys-major copies of a pool, and the layout checks the launcher uses."""

from __future__ import annotations

import pytest
import torch

from paged_video import kernels
from paged_video.kernels import pool_layout

# Block size, and the keys a padded row holds: a multiple of 16, or one key unpadded.
ROWS = [(1, 1), (7, 16), (16, 16), (24, 32), (520, 528)]


@pytest.mark.parametrize(("block_size", "row"), ROWS, ids=[str(size) for size, _ in ROWS])
@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.int8, torch.bfloat16], ids=["e4m3", "int8", "bf16"]
)
def test_keys_major_keeps_shape_and_values_with_aligned_rows(
    block_size: int, row: int, dtype: torch.dtype
) -> None:
    pool = torch.randn(3, block_size, 2, 80).to(dtype)
    copy = kernels.keys_major(pool)
    assert copy.shape == pool.shape and copy.dtype == dtype
    bits = torch.uint8 if dtype.itemsize == 1 else torch.int16
    assert torch.equal(copy.view(bits), pool.view(bits))
    assert pool_layout.padded_keys(block_size) == row
    assert copy.untyped_storage().nbytes() == 3 * 2 * 80 * row * dtype.itemsize
    # A one-slot block's pool is laid out slot-major (its slot stride is then immaterial).
    assert copy.stride()[0] == 2 * 80 * row and copy.stride()[2:] == (80 * row, row)
    assert block_size == 1 or copy.stride(1) == 1
    assert copy.data_ptr() != pool.data_ptr()
    assert pool_layout.is_keys_major(copy) == (block_size > 1)
    assert pool_layout.keys_aligned(copy) == (block_size > 1)
    assert not pool_layout.is_keys_major(pool) and not pool_layout.keys_aligned(pool)


@pytest.mark.parametrize("block_size", [7, 24, 1560])
def test_keys_major_scale_pools(block_size: int) -> None:
    scales = torch.rand(3, block_size, 5)
    copy = kernels.keys_major(scales)
    row = -(-block_size // pool_layout.KEY_ALIGNMENT) * pool_layout.KEY_ALIGNMENT
    assert copy.shape == scales.shape and torch.equal(copy, scales)
    assert copy.stride() == (5 * row, 1, row)
    assert pool_layout.keys_aligned(copy) and not pool_layout.keys_aligned(scales)
    assert not pool_layout.keys_aligned(None)


def test_unpadded_or_offset_keys_major_views_are_not_aligned() -> None:
    pool = torch.zeros(4, 24, 2, 64, dtype=torch.int8)
    unpadded = pool.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    assert pool_layout.is_keys_major(unpadded) and not pool_layout.keys_aligned(unpadded)
    padded = kernels.keys_major(pool)
    assert pool_layout.keys_aligned(padded)
    # Blocks from the second on: every stride aligned, the first element 8 bytes off.
    storage = torch.zeros(4 * 2 * 64 * 32 + 8, dtype=torch.int8)
    offset = storage[8:].view(4, 2, 64, 32)[..., :24].permute(0, 3, 1, 2)
    assert offset.stride() == padded.stride() and not pool_layout.keys_aligned(offset)


def test_keys_major_rejects_bad_pools() -> None:
    with pytest.raises(TypeError, match="pool"):
        kernels.keys_major([[1.0]])
    with pytest.raises(ValueError, match="pool must be 4-D"):
        kernels.keys_major(torch.zeros(16, 2))
