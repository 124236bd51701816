"""kernels.write_slots into quantized pools: codes and scales against the float64 oracle.

Every written row must hold nearest codes for its own scale (``nearest_code_error <= 1``), its
scale must be ``amax / QMAX``, and under the interpreter the codes must equal the oracle's bit
for bit. Slots outside the mapping keep their poison (NaN scales, NaN or -128 codes).
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
import triton
import triton.language as tl

from paged_video import kernels
from paged_video.kernels.quantize import QMAX
from paged_video.reference.quantize import K_SHARE, channel_factors, nearest_code_error, quantize
from tests.helpers import DEVICE, ON_GPU, copy_tiling

write_module = importlib.import_module("paged_video.kernels.write_slots")

# The pools with a scale per slot (the e4m3 one was deleted, issue 45: test_e4m3_pool_refused).
FORMATS = [pytest.param(torch.int8, id="int8")]
# A code no write produces: int8's -128 (the format is symmetric).
POISON_CODE = {torch.int8: 0x80}


def as_bytes(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.uint8)


@contextlib.contextmanager
def backend(name: str):
    """``triton``: the Triton kernel (the interpreter on a CPU), with this machine's tiles;
    ``gpu-tiles``: the kernel with a GPU's tile geometry; ``torch``: the plain-PyTorch path."""
    with copy_tiling(name == "gpu-tiles"), pytest.MonkeyPatch.context() as patch:
        if name == "torch":
            patch.setattr(write_module, "use_torch_path", lambda tensor: True)
        yield


def poisoned_pools(num_slots: int, heads: int, dim: int, dtype: torch.dtype):
    """Code pools full of a code no write produces, scale pools full of NaN."""
    codes = torch.full((num_slots, heads, dim), POISON_CODE[dtype], dtype=torch.uint8)
    k_pool, v_pool = codes.view(dtype).to(DEVICE), codes.view(dtype).clone().to(DEVICE)
    k_scale = torch.full((num_slots, heads), float("nan"), device=DEVICE)
    return k_pool, v_pool, k_scale, k_scale.clone()


def assert_rows_quantized(codes, scale, x, dtype, *, bitwise: bool) -> None:
    """``codes``/``scale`` hold rows ``x`` (float32, smoothing already subtracted) as specified.

    This fails on a rounding off by one code, on truncation, and on the interpreter's raw
    float32 -> float8e4nv conversion (31.2 -> 16): ``test_assertion_catches_wrong_rounding``.
    """
    qmax = QMAX[dtype]
    want_codes, want_scale = quantize(x, dtype)
    torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
    assert torch.equal(scale == 0, x.abs().amax(dim=-1) == 0), "a zero row needs scale 0"
    values = codes.to(torch.float64)
    assert not values.isnan().any(), "a NaN code was written"
    assert values.abs().max() <= qmax, "a code past QMAX was written"
    assert torch.equal(values[scale == 0], torch.zeros_like(values[scale == 0]))
    error = nearest_code_error(codes, scale, x, dtype)
    assert error.max() <= 1 + 1e-3, f"a code is {error.max().item():.3f} half-steps off"
    if bitwise:
        # The oracle rounds the exact quotient; the kernel its float32 quotient, which rarely
        # lands exactly on a midpoint between codes (then either neighbour is nearest).
        same = as_bytes(codes) == as_bytes(want_codes)
        assert (same | float32_ties(x, scale, dtype)).all(), "codes differ from the oracle's"


def float32_ties(x, scale, dtype) -> torch.Tensor:
    """Where ``x / scale`` in float32 lies exactly halfway between two codes."""
    ratio = (x.float() / scale.float().clamp_min(1e-38).unsqueeze(-1)).double().abs()
    if dtype == torch.int8:
        step = torch.ones_like(ratio)
    else:
        step = torch.exp2(torch.floor(torch.log2(ratio.clamp_min(2.0**-6))) - 3)
    return torch.frac(ratio / step) == 0.5


def smoothed(
    key: torch.Tensor, k_smooth: torch.Tensor | None, factor: torch.Tensor | None = None
) -> torch.Tensor:
    """What the write quantizes: K in float32 minus the smoothing mean, divided by the
    equalization factors (one float32 rounding each)."""
    key = key.float()
    key = key if k_smooth is None else key - k_smooth
    return key if factor is None else key / factor


def check_quantized_write(
    key, value, slots, pools, k_smooth=None, k_equalizer=None, v_equalizer=None
) -> None:
    """Write, then compare every slot: mapped ones against the oracle, others bitwise."""
    k_pool, v_pool, k_scale, v_scale = pools
    before = [t.clone() for t in pools]
    kernels.write_slots(
        key,
        value,
        k_pool,
        v_pool,
        slots,
        k_scale=k_scale,
        v_scale=v_scale,
        k_smooth=k_smooth,
        k_equalizer=k_equalizer,
        v_equalizer=v_equalizer,
    )
    mapped = slots >= 0
    written = slots[mapped].long()
    untouched = torch.ones(k_pool.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    for now, then in zip((k_pool, v_pool), before[:2], strict=True):
        assert torch.equal(as_bytes(now[untouched]), as_bytes(then[untouched]))
    for now, then in zip((k_scale, v_scale), before[2:], strict=True):
        assert now[untouched].isnan().all() and then[untouched].isnan().all()
    # Interpreter and plain PyTorch both round float32 quotients exactly as the oracle does,
    # but for ties within float32 rounding (none in these seeded examples).
    bitwise = not ON_GPU
    n = slots.shape[0]
    x_key = smoothed(key[:n][mapped], k_smooth, k_equalizer)
    x_value = smoothed(value[:n][mapped], None, v_equalizer)
    assert_rows_quantized(k_pool[written], k_scale[written], x_key, k_pool.dtype, bitwise=bitwise)
    assert_rows_quantized(v_pool[written], v_scale[written], x_value, v_pool.dtype, bitwise=bitwise)


def random_kv(tokens: int, heads: int, dim: int, seed: int, dtype=torch.float32, spread=4.0):
    """K with per-channel offsets (what smoothing removes) and V; row magnitudes spread over
    ``exp(+-spread)`` and more."""
    gen = torch.Generator().manual_seed(seed)
    offsets = 8 * torch.randn(heads, dim, generator=gen)
    magnitude = torch.exp(spread * torch.randn(tokens, heads, 1, generator=gen))
    key = offsets + magnitude * torch.randn(tokens, heads, dim, generator=gen)
    value = magnitude * torch.randn(tokens, heads, dim, generator=gen)
    mean = key.mean(dim=0)
    return key.to(dtype).to(DEVICE), value.to(dtype).to(DEVICE), mean.to(DEVICE)


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("block_size", [1, 7, 24, 1560], ids=lambda b: f"B{b}")
def test_chunk_starting_mid_block(dtype, block_size: int) -> None:
    heads, dim, num_blocks = 2, 80, 4
    num_slots = num_blocks * block_size
    start = block_size + block_size // 2  # in the middle of block 1
    length = min(2 * block_size + 3, num_slots - start)
    key, value, mean = random_kv(length, heads, dim, seed=block_size)
    slots = torch.arange(start, start + length, device=DEVICE)
    pools = poisoned_pools(num_slots, heads, dim, dtype)
    check_quantized_write(key, value, slots, pools, k_smooth=mean if block_size % 2 else None)


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("where", ["triton", "gpu-tiles", "torch"])
@pytest.mark.parametrize("smooth", [False, True], ids=["plain", "smoothed"])
@pytest.mark.parametrize(
    "heads, dim", [(1, 128), (2, 80), (5, 80), (5, 128), (40, 128)], ids=lambda v: str(v)
)
def test_padding_slots_heads_and_head_dims(dtype, where, smooth, heads, dim) -> None:
    tokens = 19
    key, value, mean = random_kv(tokens, heads, dim, seed=heads * dim)
    # 16 of the 19 tokens are mapped, three of those are padding; slots out of order.
    slots = torch.tensor([30, -1, 2, 3, 4, 17, 5, -7, 29, 0, 31, 12, 13, -1, 8, 9], device=DEVICE)
    pools = poisoned_pools(32, heads, dim, dtype)
    with backend(where):
        check_quantized_write(key, value, slots, pools, k_smooth=mean if smooth else None)


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("where", ["triton", "gpu-tiles", "torch"])
def test_equalized_channels(dtype, where) -> None:
    # Each (head, channel) divided by its factor before quantizing, K after the mean: factors
    # of both kinds (powers of two, as chosen; any positive float32, as a caller may pass),
    # 5 heads of 80 (padding heads and lanes), padding slots.
    heads, dim = 5, 80
    key, value, mean = random_kv(11, heads, dim, seed=17)
    gen = torch.Generator().manual_seed(3)
    k_equalizer = torch.exp2(torch.randint(0, 9, (heads, dim), generator=gen).float())
    v_equalizer = torch.empty(heads, dim).uniform_(0.3, 70.0, generator=gen)
    slots = torch.tensor([9, -1, 0, 4, 5, 6, 1, 2, 3, 10], device=DEVICE)
    pools = poisoned_pools(12, heads, dim, dtype)
    with backend(where):
        check_quantized_write(
            key,
            value,
            slots,
            pools,
            k_smooth=mean,
            k_equalizer=k_equalizer.to(DEVICE),
            v_equalizer=v_equalizer.to(DEVICE),
        )
    # The factors changed the codes (a write ignoring them fails the comparison above).
    plain = poisoned_pools(12, heads, dim, dtype)
    kernels.write_slots(key, value, *plain[:2], slots, k_scale=plain[2], v_scale=plain[3])
    assert not torch.equal(as_bytes(plain[1][9]), as_bytes(pools[1][9]))


@pytest.mark.parametrize("where", ["triton", "torch"])
def test_the_first_write_chooses_the_factors_once(where) -> None:
    # With the flag unset, the call chooses both factors from the rows it writes (K minus the
    # mean; padding rows ignored, even huge ones), stores with them and sets the flag; a later
    # call with other data keeps them.
    dtype, heads, dim = torch.int8, 2, 80
    key, value, mean = random_kv(9, heads, dim, seed=4, spread=0.5)
    key[:, :, :3] *= 60.0
    value[:, 1, 7] *= 20.0
    key[4], value[4] = 1e6, -1e6  # padding
    slots = torch.tensor([0, 1, 2, 3, -1, 5, 6, 7, 8], device=DEVICE)
    used = slots >= 0
    k_equalizer = torch.ones(heads, dim, device=DEVICE)
    v_equalizer = torch.ones(heads, dim, device=DEVICE)
    chosen = torch.tensor(False)
    pools = poisoned_pools(12, heads, dim, dtype)
    factors = {"k_equalizer": k_equalizer, "v_equalizer": v_equalizer}
    with backend(where):
        kernels.write_slots(
            key,
            value,
            *pools[:2],
            slots,
            k_scale=pools[2],
            v_scale=pools[3],
            k_smooth=mean,
            **factors,
            equalizers_chosen=chosen,
        )
    assert bool(chosen)
    want_k = channel_factors(key.cpu()[used.cpu()], smooth=mean.cpu(), share=K_SHARE)
    want_v = channel_factors(value.cpu()[used.cpu()])
    assert torch.equal(k_equalizer.cpu(), want_k) and torch.equal(v_equalizer.cpu(), want_v)
    assert want_k[:, :3].min() >= 4 and want_v[1, 7] >= 8 and want_v[0].max() <= 2
    # The rows were stored with the chosen factors.
    check_quantized_write(key, value, slots, poisoned_pools(12, heads, dim, dtype), mean, **factors)
    stored = poisoned_pools(12, heads, dim, dtype)
    kernels.write_slots(
        key,
        value,
        *stored[:2],
        slots,
        k_scale=stored[2],
        v_scale=stored[3],
        k_smooth=mean,
        **factors,
    )
    assert torch.equal(as_bytes(stored[0]), as_bytes(pools[0]))
    assert torch.equal(as_bytes(stored[1]), as_bytes(pools[1]))
    # Chosen: frozen.
    with backend(where):
        kernels.write_slots(
            3 * value,
            key,
            *pools[:2],
            slots,
            k_scale=pools[2],
            v_scale=pools[3],
            k_smooth=mean,
            **factors,
            equalizers_chosen=chosen,
        )
    assert torch.equal(k_equalizer.cpu(), want_k) and torch.equal(v_equalizer.cpu(), want_v)


def test_the_chosen_flag_needs_the_factors_and_a_cpu_scalar() -> None:
    key, value, _ = random_kv(4, 2, 16, seed=0)
    pools = poisoned_pools(4, 2, 16, torch.int8)
    slots = torch.arange(4, device=DEVICE)
    factors = {"k_equalizer": torch.ones(2, 16), "v_equalizer": torch.ones(2, 16)}
    for bad, word in (
        ({"k_equalizer": factors["k_equalizer"]}, "needs v_equalizer"),
        ({**factors, "equalizers_chosen": torch.tensor([False])}, "0-dim bool"),
        ({**factors, "equalizers_chosen": torch.tensor(0)}, "equalizers_chosen"),
    ):
        flag = bad.pop("equalizers_chosen", torch.tensor(False))
        with pytest.raises((ValueError, TypeError), match=word):
            kernels.write_slots(
                key,
                value,
                *pools[:2],
                slots,
                k_scale=pools[2],
                v_scale=pools[3],
                **bad,
                equalizers_chosen=flag,
            )
        assert pools[2].isnan().all() and not bool(flag.any())


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("where", ["triton", "torch"])
def test_zero_tiny_huge_and_one_hot_rows(dtype, where) -> None:
    heads, dim = 3, 80
    key, value, mean = random_kv(6, heads, dim, seed=11)
    key[0, 1] = mean[1]  # zero after smoothing: scale 0, codes 0
    value[1] = 0.0  # zero rows in every head
    value[2, 0] = 1e-30  # a tiny row: scale ~2e-33, still a float32 normal
    value[2, 2] = 0.0
    value[2, 2, 7] = -3e37  # one value: one code -QMAX, the rest 0
    value[3, 1] = torch.linspace(-1, 1, dim)  # many binades, down to codes of 0
    value[3, 1, :40] *= torch.logspace(0, -4, 40, device=value.device)
    value[4] = 6e4  # a constant row: every code QMAX
    slots = torch.tensor([5, 0, 3, 1, 2, 4], device=DEVICE)
    pools = poisoned_pools(6, heads, dim, dtype)
    with backend(where):
        check_quantized_write(key, value, slots, pools, k_smooth=mean)
    k_pool, v_pool, k_scale, v_scale = pools
    assert k_scale[5, 1] == 0 and (k_pool[5, 1].float() == 0).all()
    assert (v_scale[0] == 0).all() and (v_pool[0].float() == 0).all()
    one_hot = torch.zeros(dim, device=DEVICE)
    one_hot[7] = -QMAX[dtype]
    assert torch.equal(v_pool[3, 2].float(), one_hot)
    assert (v_pool[2].float() == QMAX[dtype]).all()


@pytest.mark.parametrize("dtype", FORMATS)
def test_half_inputs_and_strided_views(dtype) -> None:
    # fp16 K/V (bf16 where a GPU runs), value head-major, pools strided views of 4-D caches,
    # scales strided views of a (blocks, block_size, heads) pool of another layer's layout.
    heads, dim, block_size = 5, 80, 7
    key, value, mean = random_kv(9, heads, dim, seed=5, dtype=torch.float16, spread=1.0)
    value = value.transpose(0, 1).contiguous().transpose(0, 1)
    if ON_GPU:
        key, value = key.bfloat16(), value.bfloat16()
    k_base, v_pool, _, v_scale = poisoned_pools(6 * block_size, 2 * heads, dim, dtype)
    k_pool = k_base[:, ::2]
    v_pool = v_pool[:, :heads]
    scale_base = torch.full((6 * block_size, 2, heads), float("nan"), device=DEVICE)
    k_scale = scale_base[:, 1]
    v_scale = v_scale[:, 1 : heads + 1]
    slots = torch.tensor([40, 8, 9, 10, 11, 12, 13, 14, 15], device=DEVICE)
    check_quantized_write(key, value, slots, (k_pool, v_pool, k_scale, v_scale), k_smooth=mean)
    assert (as_bytes(k_base[:, 1::2]) == POISON_CODE[dtype]).all()
    assert scale_base[:, 0].isnan().all()


def test_slots_past_int32_offsets() -> None:
    dtype, heads, dim = torch.int8, 1, 64
    num_slots = 2**31 // (heads * dim) + 64
    k_pool = torch.empty(num_slots, heads, dim, dtype=dtype, device=DEVICE)  # never touched
    v_pool = torch.empty_like(k_pool)
    k_scale = torch.empty(num_slots, heads, device=DEVICE)
    v_scale = torch.empty_like(k_scale)
    slots = torch.tensor([num_slots - 1, num_slots - 40, 3], device=DEVICE)
    assert slots[0] * heads * dim > 2**31
    key, value, _ = random_kv(3, heads, dim, seed=2)
    kernels.write_slots(key, value, k_pool, v_pool, slots, k_scale=k_scale, v_scale=v_scale)
    for pool, scale, x in ((k_pool, k_scale, key), (v_pool, v_scale, value)):
        assert_rows_quantized(pool[slots], scale[slots], x, dtype, bitwise=not ON_GPU)


@pytest.mark.parametrize("k_e4m3", [True, False], ids=["e4m3-kv", "int8-k-e4m3-v"])
def test_e4m3_pool_refused(k_e4m3) -> None:
    """The deleted e4m3 pool (e4m3 codes with a scale per slot) raises naming what replaced
    it, and writes nothing."""
    key, value, _ = random_kv(4, 2, 16, seed=3)
    k_pool, v_pool, k_scale, v_scale = poisoned_pools(8, 2, 16, torch.int8)
    v_pool = torch.full(v_pool.shape, float("nan"), device=DEVICE).to(torch.float8_e4m3fn)
    if k_e4m3:
        k_pool = v_pool.clone()
    before = [t.clone() for t in (k_pool, v_pool, k_scale, v_scale)]
    slots = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match=r'e4m3 dequantizing pool.*"k8v16".*"k8v8"'):
        kernels.write_slots(key, value, k_pool, v_pool, slots, k_scale=k_scale, v_scale=v_scale)
    for tensor, old in zip((k_pool, v_pool, k_scale, v_scale), before, strict=True):
        assert torch.equal(as_bytes(tensor), as_bytes(old))


@triton.jit
def _no_rounding(ratio, IS_FP8: tl.constexpr):
    # What a kernel without the explicit rounding would do: leave it to the conversion, which
    # truncates to int8.
    return ratio


@triton.jit
def _coarse_grid(ratio, IS_FP8: tl.constexpr):
    # Rounding to a grid twice as coarse (int8: even integers up to 126): about half the
    # codes one code off.
    return tl.minimum(tl.maximum(_grid(ratio * 0.5, IS_FP8) * 2.0, -126.0), 126.0)


_grid = importlib.import_module("paged_video.kernels._quantize_jit").round_to_code_grid


@pytest.mark.skipif(ON_GPU, reason="patches the kernel's Python globals: interpreter only")
@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("broken", [_no_rounding, _coarse_grid], ids=["raw-cast", "off-by-one"])
def test_assertion_catches_wrong_rounding(dtype, broken, monkeypatch) -> None:
    """The checks above can fail: with the rounding helper broken, they do (even without the
    bitwise comparison), while the same data passes with the real one."""
    quantize_jit = importlib.import_module("paged_video.kernels._quantize_jit")
    key, value, _ = random_kv(16, 2, 80, seed=1)
    value[0, 0] = torch.linspace(31.0, 32.0, 80)  # 31.2 is the interpreter's 31.2 -> 16 case
    slots = torch.arange(16, device=DEVICE)
    pools = poisoned_pools(16, 2, 80, dtype)
    check_quantized_write(key, value, slots, [t.clone() for t in pools])
    monkeypatch.setattr(quantize_jit, "round_to_code_grid", broken)
    kernels.write_slots(key, value, pools[0], pools[1], slots, k_scale=pools[2], v_scale=pools[3])
    with pytest.raises(AssertionError):
        assert_rows_quantized(pools[1], pools[3], value.float(), dtype, bitwise=False)


@pytest.mark.parametrize("dtype", FORMATS)
def test_the_flag_makes_the_first_write_choose_the_mean_once(dtype) -> None:
    # The mean of the rows written (slot >= 0, finite values; rows past the mapping ignored),
    # recorded in the flag; a later write keeps it, and a write of no rows chooses nothing.
    heads, dim = 2, 16
    key, value, _ = random_kv(6, heads, dim, seed=7)
    key[1, 0, 3] = float("nan")
    slots = torch.tensor([4, 9, -1, 2, 7], device=DEVICE)  # row 2 skipped, row 5 unmapped
    pools = poisoned_pools(12, heads, dim, dtype)
    mean = torch.full((heads, dim), 99.0, device=DEVICE)
    chosen = torch.tensor(False)
    kwargs = dict(k_scale=pools[2], v_scale=pools[3], k_smooth=mean, k_smooth_chosen=chosen)
    kernels.write_slots(key, value, *pools[:2], slots, **kwargs, check_values=False)
    rows = key[[0, 1, 3, 4]].double()
    want = torch.where(rows.isfinite(), rows, 0).sum(0) / rows.isfinite().sum(0)
    assert bool(chosen)
    torch.testing.assert_close(mean.double(), want, rtol=1e-6, atol=1e-6)
    written = slots[[0, 3, 4]]
    x = key[[0, 3, 4]].float() - mean
    assert_rows_quantized(pools[0][written], pools[2][written], x, dtype, bitwise=not ON_GPU)
    frozen = mean.clone()
    kernels.write_slots(2 * key, value, *pools[:2], slots, **kwargs)
    assert torch.equal(mean, frozen)
    unset = torch.tensor(False)
    kernels.write_slots(key, value, *pools[:2], slots[:0], **kwargs | {"k_smooth_chosen": unset})
    assert not bool(unset) and torch.equal(mean, frozen)


def keys_major_poisoned(num_blocks: int, block_size: int, heads: int, dim: int, dtype):
    """Keys-major (``kernels.keys_major``'s layout) poisoned pools and the storages under them,
    rows' padding poisoned too."""
    row = -(-block_size // kernels.pool_layout.KEY_ALIGNMENT) * kernels.pool_layout.KEY_ALIGNMENT
    codes = torch.full((num_blocks, heads, dim, row), POISON_CODE[dtype], dtype=torch.uint8)
    storages = [codes.view(dtype).to(DEVICE), codes.view(dtype).clone().to(DEVICE)]
    storages += [torch.full((num_blocks, heads, row), float("nan"), device=DEVICE) for _ in "kv"]
    views = [s[..., :block_size].movedim(-1, 1) for s in storages]
    return views, storages


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("where", ["triton", "gpu-tiles", "torch"])
@pytest.mark.parametrize("keys_major", [False, True], ids=["slot-major", "keys-major"])
@pytest.mark.parametrize("block_size", [1, 7, 24], ids=lambda b: f"B{b}")
def test_paged_pools_in_either_layout(dtype, where, keys_major, block_size) -> None:
    # Paged pools (blocks, block_size, heads, head_dim) take the flat pools' codes and scales
    # slot for slot; keys-major ones have no flat view, and their rows' padding stays poison.
    heads, dim, num_blocks = 3, 80, 5
    num_slots = num_blocks * block_size
    flat = poisoned_pools(num_slots, heads, dim, dtype)
    if keys_major:
        paged, storages = keys_major_poisoned(num_blocks, block_size, heads, dim, dtype)
        assert kernels.pool_layout.is_keys_major(paged[0]) == (block_size > 1)
    else:
        paged = [
            t.unflatten(0, (num_blocks, block_size))
            for t in poisoned_pools(num_slots, heads, dim, dtype)
        ]
    start = block_size + block_size // 2  # mid-block
    tokens = min(2 * block_size + 3, num_slots - start)
    # In order from mid-block, one padding entry, and first the pool's first slot.
    slots = torch.arange(start, start + tokens, device=DEVICE)
    slots[1], slots[0] = -1, 0
    key, value, mean = random_kv(tokens, heads, dim, seed=block_size)
    with backend(where):
        for k_pool, v_pool, k_scale, v_scale in (flat, paged):
            kernels.write_slots(
                key, value, k_pool, v_pool, slots, k_scale=k_scale, v_scale=v_scale, k_smooth=mean
            )
    for want, got in zip(flat, paged, strict=True):
        got = got.flatten(0, 1)  # a copy for keys-major pools
        if want.dtype == dtype:
            assert torch.equal(as_bytes(got), as_bytes(want))
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    if keys_major:
        for storage in storages:
            padding = storage[..., block_size:]
            if padding.dtype == dtype:
                assert (as_bytes(padding) == POISON_CODE[dtype]).all()
            else:
                assert padding.isnan().all()
