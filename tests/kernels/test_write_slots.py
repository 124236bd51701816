"""kernels.write_slots: ragged writes land exactly where the mapping says, nowhere else."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from paged_video import kernels
from paged_video.kernels import _copy_tiles
from tests.helpers import DEVICE, copy_tiling

write_module = importlib.import_module("paged_video.kernels.write_slots")


def make_pools(num_slots: int, heads: int, dim: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)
    k_pool = torch.randn(num_slots, heads, dim, generator=gen).to(dtype).to(DEVICE)
    v_pool = torch.randn(num_slots, heads, dim, generator=gen).to(dtype).to(DEVICE)
    return k_pool, v_pool


def expected_pools(k_pool, v_pool, key, value, slot_mapping):
    """The oracle: a Python loop over tokens."""
    k_want, v_want = k_pool.clone(), v_pool.clone()
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_want[slot] = key[t].to(k_pool.dtype)
            v_want[slot] = value[t].to(v_pool.dtype)
    return k_want, v_want


def check_write(key, value, k_pool, v_pool, slot_mapping) -> None:
    k_want, v_want = expected_pools(k_pool, v_pool, key, value, slot_mapping)
    kernels.write_slots(key, value, k_pool, v_pool, slot_mapping)
    # Bit-for-bit, NaN matching NaN: every slot outside the mapping must be unchanged.
    assert torch.equal(k_pool.isnan(), k_want.isnan())
    assert torch.equal(v_pool.isnan(), v_want.isnan())
    torch.testing.assert_close(k_pool, k_want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_pool, v_want, rtol=0, atol=0, equal_nan=True)


def nan_pools(num_slots: int, heads: int, dim: int, dtype=torch.float32):
    k_pool = torch.full((num_slots, heads, dim), float("nan"), dtype=dtype, device=DEVICE)
    return k_pool, k_pool.clone()


@pytest.mark.parametrize("block_size", [1, 7, 16, 24, 1560], ids=lambda b: f"B{b}")
def test_chunk_starting_mid_block(block_size: int) -> None:
    num_blocks, heads, dim = 5, 2, 80
    k_pool, v_pool = make_pools(num_blocks * block_size, heads, dim)
    start = block_size // 2 + block_size  # in the middle of block 1
    length = min(2 * block_size + 3, num_blocks * block_size - start)
    key = torch.randn(length, heads, dim, device=DEVICE)
    value = torch.randn(length, heads, dim, device=DEVICE)
    slots = torch.arange(start, start + length, dtype=torch.int64, device=DEVICE)
    check_write(key, value, k_pool, v_pool, slots)


def test_negative_slots_are_skipped_and_mapping_may_be_short() -> None:
    k_pool, v_pool = make_pools(40, 3, 64)
    key = torch.randn(10, 3, 64, device=DEVICE)
    value = torch.randn(10, 3, 64, device=DEVICE)
    # Only 7 of the 10 tokens are mapped; two of those are padding.
    slots = torch.tensor([5, -1, 17, 39, -1, 0, 22], dtype=torch.int64, device=DEVICE)
    check_write(key, value, k_pool, v_pool, slots)


@pytest.mark.parametrize(
    "src, pool",
    [
        pytest.param(torch.float32, torch.float16, id="fp32-to-fp16"),
        pytest.param(torch.float16, torch.float32, id="fp16-to-fp32"),
    ],
)
def test_casts_to_pool_dtype(src: torch.dtype, pool: torch.dtype) -> None:
    k_pool, v_pool = make_pools(30, 2, 16, dtype=pool)
    key = torch.randn(8, 2, 16, device=DEVICE).to(src)
    value = torch.randn(8, 2, 16, device=DEVICE).to(src)
    slots = torch.tensor([3, 4, 5, 11, 12, 29, 0, 1], dtype=torch.int32, device=DEVICE)
    check_write(key, value, k_pool, v_pool, slots)


def test_strided_pool_view() -> None:
    # A flat view of a 4-D cache whose head axis is strided.
    base = torch.zeros(6, 4, 4, 32, device=DEVICE)
    k_pool = base[:, :, ::2].flatten(0, 1)
    v_pool = torch.zeros_like(k_pool)
    assert not k_pool.is_contiguous() and k_pool.data_ptr() == base.data_ptr()
    key = torch.randn(5, 2, 32, device=DEVICE)
    value = torch.randn(5, 2, 32, device=DEVICE)
    slots = torch.tensor([23, 2, 9, 10, 11], dtype=torch.int64, device=DEVICE)
    check_write(key, value, k_pool, v_pool, slots)
    assert torch.equal(base[:, :, 1::2], torch.zeros_like(base[:, :, 1::2]))


@pytest.mark.parametrize("where", ["triton", "torch"])
@pytest.mark.parametrize("keys_major", [False, True], ids=["slot-major", "keys-major"])
@pytest.mark.parametrize("block_size", [1, 7, 24], ids=lambda b: f"B{b}")
def test_paged_pools_in_either_layout(where: str, keys_major: bool, block_size: int) -> None:
    # Paged pools (blocks, block_size, heads, head_dim): slot = block * block_size + offset.
    # Keys-major ones (no flat view) sit in NaN storage whose rows' padding must stay NaN.
    num_blocks, heads, dim = 4, 2, 80
    row = -(-block_size // 16) * 16
    storages = [
        torch.full((num_blocks, heads, dim, row), float("nan"), device=DEVICE) for _ in "kv"
    ]
    if keys_major:
        k_pool, v_pool = (t[..., :block_size].movedim(-1, 1) for t in storages)
    else:
        k_pool, v_pool = nan_pools(num_blocks * block_size, heads, dim)
        k_pool, v_pool = (t.unflatten(0, (num_blocks, block_size)) for t in (k_pool, v_pool))
    start = block_size + block_size // 2
    tokens = min(2 * block_size + 3, num_blocks * block_size - start)
    slots = torch.arange(start, start + tokens, device=DEVICE)
    slots[1], slots[0] = -1, 0
    key = torch.randn(tokens, heads, dim, device=DEVICE)
    value = torch.randn(tokens, heads, dim, device=DEVICE)
    k_want, v_want = expected_pools(k_pool.flatten(0, 1), v_pool.flatten(0, 1), key, value, slots)
    with pytest.MonkeyPatch.context() as patch:
        if where == "torch":
            patch.setattr(write_module, "use_torch_path", lambda tensor: True)
        kernels.write_slots(key, value, k_pool, v_pool, slots)
    torch.testing.assert_close(k_pool.flatten(0, 1), k_want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_pool.flatten(0, 1), v_want, rtol=0, atol=0, equal_nan=True)
    if keys_major:
        assert all(t[..., block_size:].isnan().all() for t in storages)


def test_slots_past_int32_offsets() -> None:
    heads, dim = 1, 64
    num_slots = 2**31 // (heads * dim) + 64
    k_pool = torch.empty(num_slots, heads, dim, dtype=torch.float16, device=DEVICE)
    v_pool = torch.empty_like(k_pool)
    slots = torch.tensor([num_slots - 1, num_slots - 40, 3], dtype=torch.int64, device=DEVICE)
    assert slots[0] * heads * dim > 2**31
    key = torch.randn(3, heads, dim, device=DEVICE).half()
    value = torch.randn(3, heads, dim, device=DEVICE).half()
    kernels.write_slots(key, value, k_pool, v_pool, slots)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(k_pool[slot], key[t])
        assert torch.equal(v_pool[slot], value[t])


@given(
    num_slots=st.integers(1, 200),
    heads=st.sampled_from([1, 2, 3, 8]),
    dim=st.sampled_from([16, 64, 80, 128]),
    data=st.data(),
)
def test_property_matches_loop(num_slots: int, heads: int, dim: int, data) -> None:
    chosen = data.draw(st.lists(st.integers(0, num_slots - 1), unique=True, max_size=num_slots))
    padded = data.draw(
        st.lists(st.sampled_from([-1, -7]), max_size=4).map(lambda pad: chosen + pad)
    )
    padded = data.draw(st.permutations(padded))
    extra_tokens = data.draw(st.integers(0, 3))
    k_pool, v_pool = make_pools(num_slots, heads, dim)
    key = torch.randn(len(padded) + extra_tokens, heads, dim, device=DEVICE)
    value = torch.randn_like(key)
    slots = torch.tensor(padded, dtype=torch.int64, device=DEVICE)
    with copy_tiling(data.draw(st.booleans(), label="gpu tiles")):
        check_write(key, value, k_pool, v_pool, slots)


@pytest.mark.parametrize(
    "heads, dim, chunk",
    [
        pytest.param(40, 128, 1024, id="40x128"),  # 5120 = 5 x 1024: five chunks, none padded
        pytest.param(5, 80, 16, id="5x80"),  # 400 = 25 x 16: no large power-of-two divisor
        pytest.param(3, 80, 16, id="3x80"),
        pytest.param(1, 8, 8, id="1x8"),
    ],
)
def test_gpu_tiles_pad_no_lane_of_a_flat_plane(heads: int, dim: int, chunk: int, gpu_tiles) -> None:
    tiles = _copy_tiles.copy_tiles(1000, heads, dim, flat=True)
    assert tiles.block_c == chunk
    assert tiles.col_programs * tiles.block_c == heads * dim
    assert tiles.block_t * tiles.block_c == _copy_tiles.GPU_TILE


def test_gpu_tiles_of_strided_planes_take_whole_heads(gpu_tiles) -> None:
    tiles = _copy_tiles.copy_tiles(1000, 40, 128, flat=False)
    # 40 heads = 5 x 8: no padded head, 4 tokens per program.
    assert (tiles.block_c, tiles.col_programs, tiles.block_t) == (8 * 128, 5, 4)
    tiles = _copy_tiles.copy_tiles(1000, 5, 80, flat=False)
    assert (tiles.block_c, tiles.col_programs) == (1 * 128, 5)


@pytest.mark.parametrize(
    "heads, dim, tokens",
    [
        pytest.param(40, 128, 9, id="40x128-T9"),  # 4 tokens per program: 9 = 2 x 4 + 1
        pytest.param(5, 80, 300, id="5x80-T300"),  # 256 tokens per program, 25 chunks of 16
        pytest.param(2, 80, 37, id="2x80-T37"),
    ],
)
def test_gpu_tiles_ragged_token_count(heads: int, dim: int, tokens: int, gpu_tiles) -> None:
    # NaN-poisoned pools: a slot written by mistake, or a lane left unwritten, shows.
    k_pool, v_pool = nan_pools(tokens + 11, heads, dim)
    key = torch.randn(tokens, heads, dim, device=DEVICE)
    value = torch.randn(tokens, heads, dim, device=DEVICE)
    slots = torch.randperm(tokens + 11, device=DEVICE)[:tokens]
    slots[::5] = -1
    check_write(key, value, k_pool, v_pool, slots)


@pytest.mark.parametrize("gpu", [False, True], ids=["default-tiles", "gpu-tiles"])
def test_key_value_and_pools_with_different_strides(gpu: bool) -> None:
    heads, dim, tokens = 5, 80, 13
    # key contiguous, value head-major, k_pool's heads strided, v_pool contiguous.
    key = torch.randn(tokens, heads, dim, device=DEVICE)
    value = torch.randn(heads, tokens, dim, device=DEVICE).transpose(0, 1)
    base = torch.full((20, 2 * heads, dim), float("nan"), device=DEVICE)
    k_pool = base[:, ::2]
    v_pool = torch.full((20, heads, dim), float("nan"), device=DEVICE)
    slots = torch.tensor([19, 0, -1, 7, 8, 9, 3, -4, 12, 11, 1, 2, 15], device=DEVICE)
    with copy_tiling(gpu):
        check_write(key, value, k_pool, v_pool, slots)
    assert base[:, 1::2].isnan().all()


@pytest.mark.parametrize("gpu", [False, True], ids=["default-tiles", "gpu-tiles"])
def test_flat_planes_with_padded_token_strides(gpu: bool) -> None:
    # Each token's plane is contiguous but tokens are spaced apart: still the flat path.
    heads, dim, tokens = 3, 80, 21
    key = torch.randn(tokens, heads + 1, dim, device=DEVICE)[:, :heads]
    value = torch.randn(tokens, 2, heads, dim, device=DEVICE)[:, 1]
    k_pool, v_pool = nan_pools(30, heads, dim)
    assert all(_copy_tiles.plane_is_flat(t) for t in (key, value, k_pool, v_pool))
    slots = torch.randperm(30, device=DEVICE)[:tokens]
    with copy_tiling(gpu):
        check_write(key, value, k_pool, v_pool, slots)
