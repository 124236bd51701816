"""kernels.gather_blocks: blocks land at j * block_size; every other staging row is untouched."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from paged_video import kernels
from tests.helpers import DEVICE, copy_tiling


def make_caches(num_blocks: int, block_size: int, heads: int, dim: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    shape = (num_blocks, block_size, heads, dim)
    k = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    return k, v


def check_gather(k_cache, v_cache, block_ids, stage_rows, first_block) -> None:
    heads, dim = k_cache.shape[2:]
    block_size = k_cache.shape[1]
    stage_k = torch.full((stage_rows, heads, dim), float("nan"), device=DEVICE)
    stage_v = torch.full((stage_rows, heads, dim), float("nan"), device=DEVICE)
    k_want, v_want = stage_k.clone(), stage_v.clone()
    for j, block in enumerate(block_ids.tolist()):
        if j >= first_block:
            k_want[j * block_size : (j + 1) * block_size] = k_cache[block]
            v_want[j * block_size : (j + 1) * block_size] = v_cache[block]
    kernels.gather_blocks(k_cache, v_cache, block_ids, stage_k, stage_v, first_block=first_block)
    # equal_nan: the untouched rows before first_block and after the last block stay NaN.
    assert torch.equal(stage_k.isnan(), k_want.isnan())
    assert torch.equal(stage_v.isnan(), v_want.isnan())
    torch.testing.assert_close(stage_k, k_want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(stage_v, v_want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("block_size", [1, 7, 16, 24, 1560], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("first_block", [0, 2])
def test_gather_permuted_blocks(block_size: int, first_block: int) -> None:
    k_cache, v_cache = make_caches(6, block_size, 2, 80)
    block_ids = torch.tensor([4, 0, 5, 2], dtype=torch.int32, device=DEVICE)
    # Room for one more block past the last copied one: it must stay untouched.
    check_gather(k_cache, v_cache, block_ids, 5 * block_size + 3, first_block)


def test_repeated_blocks_and_int64_ids() -> None:
    k_cache, v_cache = make_caches(4, 8, 3, 64)
    block_ids = torch.tensor([1, 1, 3, 1], dtype=torch.int64, device=DEVICE)
    check_gather(k_cache, v_cache, block_ids, 40, 1)


def test_first_block_at_end_copies_nothing() -> None:
    k_cache, v_cache = make_caches(4, 8, 1, 16)
    block_ids = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    check_gather(k_cache, v_cache, block_ids, 16, 2)


def test_block_ids_past_int32_offsets() -> None:
    block_size, heads, dim = 16, 1, 64
    per_block = block_size * heads * dim
    num_blocks = 2**31 // per_block + 4
    k_cache = torch.empty(num_blocks, block_size, heads, dim, dtype=torch.float16, device=DEVICE)
    v_cache = torch.empty_like(k_cache)
    far = num_blocks - 2
    assert far * per_block > 2**31
    k_cache[far] = torch.randn(block_size, heads, dim).half()
    v_cache[far] = torch.randn(block_size, heads, dim).half()
    stage_k = torch.zeros(2 * block_size, heads, dim, dtype=torch.float16, device=DEVICE)
    stage_v = torch.zeros_like(stage_k)
    block_ids = torch.tensor([0, far], dtype=torch.int32, device=DEVICE)
    kernels.gather_blocks(k_cache, v_cache, block_ids, stage_k, stage_v, first_block=1)
    assert torch.equal(stage_k[block_size:], k_cache[far])
    assert torch.equal(stage_v[block_size:], v_cache[far])
    assert torch.equal(stage_k[:block_size], torch.zeros_like(stage_k[:block_size]))


@given(
    block_size=st.integers(1, 40),
    num_blocks=st.integers(1, 8),
    heads=st.sampled_from([1, 2, 5]),
    dim=st.sampled_from([16, 80]),
    data=st.data(),
)
def test_property_matches_loop(block_size, num_blocks, heads, dim, data) -> None:
    ids = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=1, max_size=6))
    first_block = data.draw(st.integers(0, len(ids)))
    spare_rows = data.draw(st.integers(0, 2 * block_size))
    k_cache, v_cache = make_caches(num_blocks, block_size, heads, dim)
    block_ids = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
    with copy_tiling(data.draw(st.booleans(), label="gpu tiles")):
        check_gather(k_cache, v_cache, block_ids, len(ids) * block_size + spare_rows, first_block)


def poison_unlisted(k_cache, v_cache, block_ids) -> None:
    """NaN in every cache block not in ``block_ids``: reading a wrong block shows."""
    unlisted = torch.ones(k_cache.shape[0], dtype=torch.bool, device=DEVICE)
    unlisted[block_ids.long()] = False
    k_cache[unlisted] = float("nan")
    v_cache[unlisted] = float("nan")


@pytest.mark.parametrize(
    "block_size, heads, dim",
    [
        pytest.param(1, 40, 128, id="B1-40x128"),  # 4 rows per program, 5 chunks of 1024
        pytest.param(7, 40, 128, id="B7-40x128"),  # tiles straddle block edges
        pytest.param(24, 5, 80, id="B24-5x80"),  # 256 rows per program, 25 chunks of 16
        pytest.param(1560, 1, 16, id="B1560-1x16"),
    ],
)
@pytest.mark.parametrize("first_block", [0, 1])
def test_gpu_tiles_any_block_size(block_size, heads, dim, first_block, gpu_tiles) -> None:
    k_cache, v_cache = make_caches(6, block_size, heads, dim)
    block_ids = torch.tensor([3, 5, 3, 1], dtype=torch.int32, device=DEVICE)
    poison_unlisted(k_cache, v_cache, block_ids[first_block:])
    check_gather(k_cache, v_cache, block_ids, 4 * block_size + 5, first_block)


@pytest.mark.parametrize("gpu", [False, True], ids=["default-tiles", "gpu-tiles"])
def test_caches_and_staging_with_different_strides(gpu: bool) -> None:
    block_size, heads, dim = 7, 5, 80
    k_cache, _ = make_caches(5, block_size, heads, dim)
    # v_cache head-major inside each block; the staging buffers are strided views.
    v_cache = torch.randn(5, heads, block_size, dim, device=DEVICE).transpose(1, 2)
    block_ids = torch.tensor([4, 2, 0], dtype=torch.int64, device=DEVICE)
    rows = 3 * block_size + 2
    stage_k = torch.full((rows, 2 * heads, dim), float("nan"), device=DEVICE)[:, 1::2]
    stage_v = torch.full((heads, rows, dim), float("nan"), device=DEVICE).transpose(0, 1)
    k_want, v_want = stage_k.clone(), stage_v.clone()
    for j, block in enumerate(block_ids.tolist()[1:], start=1):
        k_want[j * block_size : (j + 1) * block_size] = k_cache[block]
        v_want[j * block_size : (j + 1) * block_size] = v_cache[block]
    with copy_tiling(gpu):
        kernels.gather_blocks(k_cache, v_cache, block_ids, stage_k, stage_v, first_block=1)
    torch.testing.assert_close(stage_k, k_want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(stage_v, v_want, rtol=0, atol=0, equal_nan=True)
    assert stage_k[:block_size].isnan().all() and stage_v[-2:].isnan().all()
