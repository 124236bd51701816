"""kernels.write_slots into k8v8 pools (int8 K per slot, e4m3 V per block and channel) against a
float64 quantizer of its own: ragged writes, chunks starting mid-block, negative slots skipped,
pools poisoned outside the written slots, V stored keys-major; frozen and per-block V scales,
saturation counted."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import Tensor

from paged_video import kernels
from paged_video.kernels import pool_layout, value_channels
from tests.helpers import DEVICE

write_module = importlib.import_module("paged_video.kernels.write_slots")
E4M3_NAN = 0x7F


def float64_k8v8(key: Tensor, value: Tensor, v_scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """K's int8 codes and scales per row (amax / 127, nearest, ties to even) and V's e4m3 codes
    of the given per-row channel scales ``v_scale`` (rows, heads, dim), saturating: float64,
    rounded once (the float32 quotient of float32 operands, then its nearest e4m3)."""
    key = key.double()
    k_scale = (key.abs().amax(dim=-1) / 127).float()
    divisor = torch.where(k_scale > 0, k_scale, 1.0).double()[..., None]
    k_codes = torch.round(key / divisor).clamp(-127, 127).to(torch.int8)
    divisor = torch.where(v_scale > 0, v_scale, 1.0).double()
    ratio = torch.where(v_scale > 0, value.double() / divisor, 0.0).float().clamp(-448, 448)
    return k_codes, k_scale, ratio.to(torch.float8_e4m3fn)


def poisoned(blocks: int, block_size: int, heads: int, dim: int):
    k_pool = torch.full((blocks, block_size, heads, dim), -128, dtype=torch.int8)
    v_pool = pool_layout.empty_keys_major(blocks, block_size, heads, dim, dtype=torch.float8_e4m3fn)
    v_pool.view(torch.uint8).fill_(E4M3_NAN)
    k_scale = torch.full((blocks, block_size, heads), float("nan"))
    return k_pool.to(DEVICE), v_pool.to(DEVICE), k_scale.to(DEVICE)


def first_write_scales(value: Tensor, slots: Tensor, headroom: float) -> Tensor:
    """The frozen scales, float64: per (head, channel) the largest magnitude of the rows with a
    slot times headroom / 448; a zero channel's its head's largest, a zero head's 1."""
    scale = value[slots >= 0].double().abs().amax(dim=0) * headroom / 448
    head = scale.amax(dim=-1, keepdim=True)
    return torch.where(scale > 0, scale, torch.where(head > 0, head, 1.0))


@pytest.mark.parametrize("block_size", [1, 7, 24, 1560], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "per-block"])
def test_k8v8_write_against_float64(block_size: int, frozen: bool) -> None:
    heads, dim = 2, 80
    blocks = 3 if block_size == 1560 else max(4, 90 // block_size + 2)
    k_pool, v_pool, k_scale = poisoned(blocks, block_size, heads, dim)
    if frozen:
        scales = value_channels.frozen_channel_scales(blocks, heads, dim, DEVICE)
    else:
        scales = torch.full((blocks, heads, dim), float("nan"), device=DEVICE)
    chosen = torch.tensor(False) if frozen else None
    saturated = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(block_size)
    order = torch.randperm(blocks, generator=gen)  # the chunk's blocks, any order
    slots_of = lambda keys: order[keys // block_size] * block_size + keys % block_size
    headroom = 4.0
    # Chunk 1 starts in block 0's slot 0 and ends mid-block; chunk 2 starts there (mid-block)
    # and has padding rows; the last block of chunk 2 is left partly unwritten.
    first_keys = min(block_size * 2 - 1, 40) if block_size > 1 else 2
    end = min(blocks * block_size - 2, first_keys + 50)
    runs = [torch.arange(0, first_keys), torch.arange(first_keys, end)]
    written = torch.zeros(blocks * block_size, dtype=torch.bool)
    want_scales = torch.zeros(blocks, heads, dim, dtype=torch.float64)
    for n, keys in enumerate(runs):
        slots = slots_of(keys)
        if n == 1:
            slots[::5] = -1  # padding
        key = torch.randn(len(keys) + 3, heads, dim, generator=gen) * 3
        value = torch.randn(len(keys) + 3, heads, dim, generator=gen) * (1 + 20 * n)
        mapping = slots.to(torch.int32)
        kernels.write_slots(
            key.to(DEVICE), value.to(DEVICE), k_pool, v_pool, mapping.to(DEVICE),
            k_scale=k_scale, v_channel_scale=scales, v_scale_chosen=chosen,
            v_headroom=headroom, v_saturated=saturated,
        )  # fmt: skip
        key, value = key[: len(keys)], value[: len(keys)]
        keep = slots >= 0
        if n == 0 and frozen:
            want_scales[:] = first_write_scales(value, slots, headroom)
        elif not frozen:
            for b in range(blocks):
                mine = keep & (slots // block_size == b)
                if (mine & (slots % block_size == 0)).any():
                    want_scales[b] = first_write_scales(value[mine], slots[mine], headroom)
        got_scales = scales.cpu().double()
        touched = want_scales.abs().sum(dim=(1, 2)) > 0
        assert torch.allclose(got_scales[touched], want_scales[touched], rtol=1e-6, atol=0)
        if not frozen:
            assert got_scales[~touched].isnan().all(), "an untouched block's scales changed"
        slot_scale = scales.cpu()[slots[keep] // block_size]
        k_codes, k_rows_scale, v_codes = float64_k8v8(key[keep], value[keep], slot_scale)
        block, offset = slots[keep] // block_size, slots[keep] % block_size
        assert torch.equal(k_pool.cpu()[block, offset], k_codes)
        assert torch.equal(k_scale.cpu()[block, offset], k_rows_scale)
        got_v = v_pool.cpu()[block, offset].view(torch.uint8)
        assert torch.equal(got_v, v_codes.view(torch.uint8)), "V codes differ from float64's"
        written[slots[keep]] = True
        if n == 0:
            assert int(saturated) == 0
    # Chunk 2's values are 21x chunk 1's: past a frozen headroom of 4 some saturate, counted
    # exactly; slots never written keep their poison.
    if frozen:
        ratio = value[keep].double() / scales.cpu()[0].double()
        assert int(saturated) == int((ratio.abs() > 448).sum()) > 0
    unwritten = ~written.reshape(blocks, block_size)
    assert (k_pool.cpu()[unwritten] == -128).all()
    assert k_scale.cpu()[unwritten].isnan().all()
    assert (v_pool.cpu()[unwritten].view(torch.uint8) == E4M3_NAN).all()
    assert bool(chosen) if frozen else True


def test_frozen_scales_are_chosen_once() -> None:
    blocks, block_size, heads, dim = 2, 16, 1, 32
    k_pool, v_pool, k_scale = poisoned(blocks, block_size, heads, dim)
    scales = value_channels.frozen_channel_scales(blocks, heads, dim, DEVICE)
    chosen = torch.tensor(False)
    slots = torch.arange(4, dtype=torch.int32, device=DEVICE)
    value = torch.ones(4, heads, dim, device=DEVICE)
    kwargs = dict(k_scale=k_scale, v_channel_scale=scales, v_scale_chosen=chosen)
    kernels.write_slots(value, value, k_pool, v_pool, slots, **kwargs)
    first = scales.clone()
    kernels.write_slots(value * 3, value * 3, k_pool, v_pool, slots + 4, **kwargs)
    assert torch.equal(scales, first) and torch.allclose(first, torch.full_like(first, 256 / 448))
    assert scales.stride(0) == 0


@pytest.mark.parametrize(
    "change, error, match",
    [
        ("v_scale", ValueError, "replaces v_scale"),
        ("int8_v", TypeError, "float8_e4m3fn v_pool"),
        ("shape", ValueError, "v_channel_scale must have shape"),
        ("headroom", ValueError, "v_headroom"),
        ("chosen_per_block", ValueError, "frozen"),
        ("saturated", ValueError, "v_saturated"),
    ],
)
def test_k8v8_write_refuses_bad_arguments(change: str, error: type, match: str) -> None:
    k_pool, v_pool, k_scale = poisoned(2, 8, 1, 32)
    scales = value_channels.frozen_channel_scales(2, 1, 32, DEVICE)
    kwargs = dict(k_scale=k_scale, v_channel_scale=scales, v_scale_chosen=torch.tensor(False))
    if change == "v_scale":
        kwargs["v_scale"] = k_scale.clone()
    elif change == "int8_v":
        v_pool = torch.zeros(v_pool.shape, dtype=torch.int8, device=DEVICE)
    elif change == "shape":
        kwargs["v_channel_scale"] = torch.zeros(2, 1, 16, device=DEVICE)
    elif change == "headroom":
        kwargs["v_headroom"] = 0.5
    elif change == "chosen_per_block":
        kwargs["v_channel_scale"] = torch.zeros(2, 1, 32, device=DEVICE)
    elif change == "saturated":
        kwargs["v_saturated"] = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    before = (k_pool.clone(), k_scale.clone(), scales.clone())
    rows = torch.ones(3, 1, 32, device=DEVICE)
    with pytest.raises(error, match=match):
        kernels.write_slots(
            rows, rows, k_pool, v_pool, torch.arange(3, dtype=torch.int32, device=DEVICE), **kwargs
        )
    assert torch.equal(k_pool, before[0]) and torch.equal(scales, before[2])
    assert not bool(kwargs["v_scale_chosen"])


def test_torch_path_writes_as_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    got = []
    for torch_path in (False, True):
        if torch_path:
            monkeypatch.setattr(write_module, "use_torch_path", lambda tensor: True)
        k_pool, v_pool, k_scale = poisoned(4, 7, 2, 48)
        scales = torch.zeros(4, 2, 48, device=DEVICE)
        saturated = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        gen = torch.Generator().manual_seed(5)
        rows = (torch.randn(12, 2, 48, generator=gen) * 5).to(DEVICE)
        slots = torch.tensor([7, 8, 9, -1, 10, 11, 12, 13, 0, 1, 2, 3], dtype=torch.int32)
        kwargs = dict(k_scale=k_scale, v_channel_scale=scales, v_headroom=1.0)
        kernels.write_slots(rows, rows, k_pool, v_pool, slots.to(DEVICE), **kwargs)
        kernels.write_slots(
            rows * 2, rows * 2, k_pool, v_pool, (slots + 14).to(DEVICE), **kwargs,
            v_saturated=saturated,
        )  # fmt: skip
        got.append((k_pool, v_pool.view(torch.uint8), k_scale, scales, saturated))
    for a, b in zip(*got, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("torch_path", [False, True], ids=["kernel", "torch-path"])
def test_rows_lost_under_frozen_scales_are_counted(
    monkeypatch: pytest.MonkeyPatch, torch_path: bool
) -> None:
    # Issue 45's v-small: rows far below the frozen channel scales store all-zero codes, a
    # whole key's value lost; never silently: their nonzero elements join the saturated count.
    # A zero row loses nothing, and a row keeping one nonzero code is not lost.
    if torch_path:
        monkeypatch.setattr(write_module, "use_torch_path", lambda tensor: True)
    blocks, block_size, heads, dim = 2, 16, 2, 48
    k_pool, v_pool, k_scale = poisoned(blocks, block_size, heads, dim)
    scales = value_channels.frozen_channel_scales(blocks, heads, dim, DEVICE)
    kwargs = dict(k_scale=k_scale, v_channel_scale=scales, v_scale_chosen=torch.tensor(False))
    gen = torch.Generator().manual_seed(8)
    first = torch.randn(8, heads, dim, generator=gen).to(DEVICE)
    kernels.write_slots(
        first, first, k_pool, v_pool, torch.arange(8).to(DEVICE, torch.int32), **kwargs
    )
    saturated = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    value = torch.randn(6, heads, dim, generator=gen)
    value[0] *= 1e-6  # both heads lost
    value[1, 1] *= 1e-6  # head 1 lost
    value[2] = 0.0  # nothing to lose
    value[3] *= 1e-6
    value[3, 0, 5] = 1.0  # keeps a code: not lost
    value[3, 0, 6] = 0.0
    value = value.to(DEVICE)
    slots = torch.arange(8, 14).to(DEVICE, torch.int32)
    kernels.write_slots(value, value, k_pool, v_pool, slots, **kwargs, v_saturated=saturated)
    lost = (
        value.cpu()[0].ne(0).sum() + value.cpu()[1, 1].ne(0).sum() + value.cpu()[3, 1].ne(0).sum()
    )
    assert int(saturated) == int(lost) == 4 * dim
    codes = v_pool.cpu()[0, 8:14].float()
    assert (codes[0] == 0).all() and (codes[3, 0] != 0).any()
