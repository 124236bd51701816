"""kernels.gather_blocks from quantized caches: codes staged bit for bit, scales beside them.

The caches are filled by ``write_slots`` (what a forward stages is what was written), then the
blocks not listed are poisoned, and the staging buffers start poisoned: entry ``j >=
first_block`` must land at rows ``j * block_size ..`` exactly, every other row untouched.
"""

from __future__ import annotations

import contextlib
import importlib
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from paged_video import kernels
from paged_video.kernels.pool_layout import keys_aligned, keys_major
from paged_video.reference.quantize import nearest_code_error
from tests.helpers import DEVICE, copy_tiling

gather_module = importlib.import_module("paged_video.kernels.gather_blocks")

# The pools with a scale per slot (the e4m3 one was deleted, issue 45).
FORMATS = [pytest.param(torch.int8, id="int8")]


def as_bytes(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.uint8)


@contextlib.contextmanager
def backend(name: str):
    """``triton`` (this machine's tiles), ``gpu-tiles`` (a GPU's tile geometry, several
    programs per row, so only some copy the scales) or ``torch`` (the plain-PyTorch path)."""
    with copy_tiling(name == "gpu-tiles"), pytest.MonkeyPatch.context() as patch:
        if name == "torch":
            patch.setattr(gather_module, "use_torch_path", lambda tensor: True)
        yield


def written_caches(num_blocks, block_size, heads, dim, dtype, seed=0):
    """Quantized caches filled by ``write_slots`` (K smoothed), and the rows it quantized."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, heads, dim)
    key = 3 * torch.randn(shape, generator=gen) + torch.randn(heads, dim, generator=gen)
    value = torch.randn(shape, generator=gen)
    k_smooth = key.flatten(0, 1).mean(dim=0).to(DEVICE)
    key, value = key.to(DEVICE), value.to(DEVICE)
    k_cache = torch.empty(shape, dtype=dtype, device=DEVICE)
    v_cache = torch.empty_like(k_cache)
    k_scale = torch.empty(shape[:-1], device=DEVICE)
    v_scale = torch.empty_like(k_scale)
    slots = torch.arange(num_blocks * block_size, device=DEVICE)
    kernels.write_slots(
        key.flatten(0, 1),
        value.flatten(0, 1),
        k_cache.flatten(0, 1),
        v_cache.flatten(0, 1),
        slots,
        k_scale=k_scale.flatten(0, 1),
        v_scale=v_scale.flatten(0, 1),
        k_smooth=k_smooth,
    )
    return (k_cache, v_cache, k_scale, v_scale), (key - k_smooth, value)


def poison_blocks(caches, blocks) -> None:
    """NaN scales and the all-ones byte (int8 -1) in codes of ``blocks``."""
    for codes in caches[:2]:
        as_bytes(codes)[blocks] = 0xFF
    for scale in caches[2:]:
        scale[blocks] = float("nan")


def poisoned_staging(rows, heads, dim, dtype):
    codes = [torch.full((rows, heads, dim), 0x7F, dtype=torch.uint8, device=DEVICE) for _ in "kv"]
    scales = [torch.full((rows, heads), float("nan"), device=DEVICE) for _ in "kv"]
    return [c.view(dtype) for c in codes] + scales


def check_gather(caches, block_ids, staging, first_block, where="triton") -> None:
    """Gather, then compare every staging row with a Python loop over the entries."""
    block_size = caches[0].shape[1]
    want = [t.clone() for t in staging]
    for j, block in enumerate(block_ids.tolist()):
        if j >= first_block:
            for dst, src in zip(want, caches, strict=True):
                dst[j * block_size : (j + 1) * block_size] = src[block]
    k_cache, v_cache, k_scale, v_scale = caches
    stage_k, stage_v, stage_k_scale, stage_v_scale = staging
    with backend(where):
        kernels.gather_blocks(
            k_cache,
            v_cache,
            block_ids,
            stage_k,
            stage_v,
            k_scale=k_scale,
            v_scale=v_scale,
            stage_k_scale=stage_k_scale,
            stage_v_scale=stage_v_scale,
            first_block=first_block,
        )
    for got, expected in zip(staging[:2], want[:2], strict=True):
        assert torch.equal(as_bytes(got), as_bytes(expected)), "codes differ"
    for got, expected in zip(staging[2:], want[2:], strict=True):
        assert torch.equal(got.isnan(), expected.isnan()), "a scale row moved or was skipped"
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("block_size", [1, 7, 24, 1560], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("first_block", [0, 2])
def test_stages_what_was_written(dtype, block_size: int, first_block: int) -> None:
    heads, dim = (1 if block_size > 100 else 2), 80  # 1560: few programs under the interpreter
    caches, (key, value) = written_caches(4, block_size, heads, dim, dtype)
    block_ids = torch.tensor([3, 0, 1], dtype=torch.int32, device=DEVICE)
    poison_blocks(caches, [2])
    staging = poisoned_staging(4 * block_size + 3, heads, dim, dtype)
    check_gather(caches, block_ids, staging, first_block)
    # The staged rows are nearest codes of the K (smoothed) and V that were written.
    rows = slice(first_block * block_size, 3 * block_size)
    ids = block_ids[first_block:].long()
    for codes, scale, x in ((staging[0], staging[2], key), (staging[1], staging[3], value)):
        error = nearest_code_error(codes[rows], scale[rows], x[ids].flatten(0, 1), dtype)
        assert error.max() <= 1 + 1e-3


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("where", ["triton", "gpu-tiles", "torch"])
@pytest.mark.parametrize(
    "block_size, heads, dim",
    [(7, 1, 128), (7, 5, 80), (24, 2, 128), (1, 40, 128)],
    ids=lambda v: str(v),
)
def test_repeated_ids_and_nan_codes(dtype, where, block_size, heads, dim) -> None:
    caches, _ = written_caches(5, block_size, heads, dim, dtype, seed=block_size)
    block_ids = torch.tensor([3, 1, 3, 4], dtype=torch.int64, device=DEVICE)
    poison_blocks(caches, [0, 2])
    # -1 codes inside a listed block are copied as they are.
    as_bytes(caches[0])[3, 0, 0, :5] = 0xFF
    staging = poisoned_staging(4 * block_size + 2, heads, dim, dtype)
    check_gather(caches, block_ids, staging, 1, where)


@pytest.mark.parametrize("dtype", FORMATS)
def test_strided_caches_and_staging(dtype) -> None:
    block_size, heads, dim = 7, 5, 80
    caches, _ = written_caches(5, block_size, heads, dim, dtype)
    # v_cache head-major inside each block; k staging and its scales strided views.
    v_cache = caches[1].transpose(1, 2).contiguous().transpose(1, 2)
    v_scale = caches[3].transpose(1, 2).contiguous().transpose(1, 2)
    caches = (caches[0], v_cache, caches[2], v_scale)
    rows = 3 * block_size + 2
    stage_k, stage_v, stage_k_scale, stage_v_scale = poisoned_staging(rows, 2 * heads, dim, dtype)
    staging = [stage_k[:, 1::2], stage_v[:, :heads], stage_k_scale[:, ::2], stage_v_scale[:, 1::2]]
    check_gather(caches, torch.tensor([4, 2, 0], device=DEVICE), staging, 1, "gpu-tiles")
    assert (as_bytes(stage_k[:, ::2]) == 0x7F).all() and stage_k_scale[:, 1::2].isnan().all()


@given(
    block_size=st.integers(1, 20),
    num_blocks=st.integers(1, 5),
    heads=st.sampled_from([1, 2, 5]),
    dtype=st.just(torch.int8),
    data=st.data(),
)
def test_property_matches_loop(block_size, num_blocks, heads, dtype, data) -> None:
    ids = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=1, max_size=5))
    first_block = data.draw(st.integers(0, len(ids)))
    spare = data.draw(st.integers(0, block_size))
    caches, _ = written_caches(num_blocks, block_size, heads, 16, dtype)
    block_ids = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
    staging = poisoned_staging(len(ids) * block_size + spare, heads, 16, dtype)
    where = data.draw(st.sampled_from(["triton", "gpu-tiles", "torch"]), label="backend")
    check_gather(caches, block_ids, staging, first_block, where)


def eight_bit_k_caches(num_blocks, block_size, heads, dim, v_dtype, seed=0):
    """k8v8 (e4m3 V) or k8v16 (float V) pools laid out as the cache lays them out: int8 K
    codes slot-major, K's scales and e4m3 V keys-major; random bytes, NaN codes included."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, heads, dim)
    k_cache = torch.randint(-128, 128, shape, dtype=torch.int8, generator=gen)
    # Keys-major copies made on the device: one moved there loses its padding (Tensor.to packs
    # a tensor that is not dense), and its rows their 16-byte alignment.
    k_scale = keys_major(torch.rand(shape[:-1], generator=gen).to(DEVICE))
    if v_dtype == torch.float8_e4m3fn:
        v_bytes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        v_cache = keys_major(v_bytes.view(v_dtype).to(DEVICE))
    else:
        v_cache = torch.randn(shape, generator=gen).to(v_dtype)
        v_cache.view(-1)[::7] = float("nan")
        v_cache = v_cache.to(DEVICE)
    return k_cache.to(DEVICE), v_cache, k_scale


def test_the_k8_caches_are_laid_out_as_the_cache_on_the_device(monkeypatch) -> None:
    # The meta device stands in for a GPU: blocks of 7 keys are padded to 16 a row.
    monkeypatch.setattr(sys.modules[__name__], "DEVICE", torch.device("meta"))
    _, v_cache, k_scale = eight_bit_k_caches(3, 7, 2, 16, torch.float8_e4m3fn)
    assert v_cache.device.type == "meta" and keys_aligned(v_cache) and keys_aligned(k_scale)


@pytest.mark.parametrize("v_dtype", [torch.float8_e4m3fn, torch.float32], ids=["k8v8", "k8v16"])
@pytest.mark.parametrize("where", ["triton", "gpu-tiles", "torch"])
@pytest.mark.parametrize("block_size, heads, dim", [(1, 3, 16), (7, 2, 80), (24, 1, 16)])
def test_k8_formats_stage_k_scales_and_v_as_stored(v_dtype, where, block_size, heads, dim):
    # int8 K with K's scales, V with none (k8v8's channel scales stay with the caller): the
    # listed entries from first_block on land bit for bit, every other row stays poisoned.
    k_cache, v_cache, k_scale = eight_bit_k_caches(5, block_size, heads, dim, v_dtype)
    block_ids = torch.tensor([3, 1, 3, 4], dtype=torch.int32, device=DEVICE)
    rows, first = 4 * block_size + 2, 1
    stage_k = torch.full((rows, heads, dim), -128, dtype=torch.int8, device=DEVICE)
    stage_v = torch.full((rows, heads, dim), 0x7F, dtype=torch.uint8, device=DEVICE)
    if v_dtype != torch.float8_e4m3fn:
        stage_v = torch.full((rows, heads, dim), float("nan"), dtype=v_dtype, device=DEVICE)
    stage_v = stage_v.view(v_dtype)
    stage_k_scale = torch.full((rows, heads), float("nan"), device=DEVICE)
    want = [t.clone() for t in (stage_k, stage_v, stage_k_scale)]
    for j, block in enumerate(block_ids.tolist()[first:], start=first):
        for dst, src in zip(want, (k_cache, v_cache, k_scale), strict=True):
            dst[j * block_size : (j + 1) * block_size] = src[block]
    with backend(where):
        kernels.gather_blocks(
            k_cache,
            v_cache,
            block_ids,
            stage_k,
            stage_v,
            k_scale=k_scale,
            stage_k_scale=stage_k_scale,
            first_block=first,
        )
    for got, expected in zip((stage_k, stage_v, stage_k_scale), want, strict=True):
        assert torch.equal(as_bytes(got), as_bytes(expected)), "a row differs from the cache's"


def test_k8_formats_refuse_v_scales_half_given() -> None:
    # A V scale pool beside int8 K and e4m3 V is the deleted e4m3 pool's spelling, refused
    # naming k8v8 (which has no V scales); float V with int8 K and a V scale is neither format.
    k_cache, v_cache, k_scale = eight_bit_k_caches(2, 4, 1, 16, torch.float8_e4m3fn)
    stage_k = torch.zeros(8, 1, 16, dtype=torch.int8, device=DEVICE)
    stage_v = torch.zeros(8, 1, 16, dtype=torch.float8_e4m3fn, device=DEVICE)
    ids = torch.tensor([1, 0], device=DEVICE)
    scales = {"k_scale": k_scale, "stage_k_scale": torch.zeros(8, 1, device=DEVICE)}
    with pytest.raises(ValueError, match=r'v_cache=torch.float8_e4m3fn .*deleted.*"k8v8"'):
        kernels.gather_blocks(
            k_cache, v_cache, ids, stage_k, stage_v, **scales, stage_v_scale=scales["stage_k_scale"]
        )
    float_v = torch.zeros(2, 4, 1, 16, device=DEVICE)
    with pytest.raises(TypeError, match="v_cache is torch"):
        kernels.gather_blocks(
            k_cache, float_v, ids, stage_k, stage_v.float(), **scales, v_scale=k_scale
        )
    # e4m3 V beside float K is no format either (k8v8's K is int8).
    float_k = torch.zeros(2, 4, 1, 16, device=DEVICE)
    with pytest.raises(TypeError, match=r"v_cache is torch\.float8_e4m3fn but k_cache is torch"):
        kernels.gather_blocks(float_k, v_cache, ids, stage_k.float(), stage_v)
    assert not stage_k.any() and not stage_v.float().any()
