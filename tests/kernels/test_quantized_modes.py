"""paged_attention's int8 ``Q K^T`` sums, channel equalization factors, and every quantized mode
over V scales of any range a pool can hold (the INT8-MMA and FP8-MMA modes and the e4m3 pool
were deleted, issue 45). Pools are NaN-poisoned outside what the tables point at, outputs
NaN-poisoned before the launch.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import Tensor

from paged_video import kernels
from paged_video.kernels.paged_attention import choose_tiles
from paged_video.reference.quantized_attention import paged_quantized_attention
from tests.helpers import DEVICE, nan_like
from tests.kernels.paged_case import assert_lse_close, make_paged_case
from tests.kernels.test_paged_attention_quantized import (
    FP32_ATOL,
    LSE_RTOL,
    no_interpreter,  # noqa: F401 (a fixture)
    oracle,
    quantized_args,
)

launcher = importlib.import_module("paged_video.kernels.paged_attention")


def emulate(args: tuple, scales: dict, mode: str, **kwargs) -> Tensor:
    """Float64 attention over the case's codes in ``mode``, on the CPU."""
    scales = {name: scales[name] for name in ("k_scale", "v_scale")}
    return paged_quantized_attention(*args, **scales, mode=mode, **kwargs)


def factors(num_kv_heads: int, head_dim: int, seed: int) -> tuple[Tensor, Tensor]:
    """K and V equalization factors: powers of two from 1 to 2**5, as chosen ones are."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (
        torch.exp2(torch.randint(0, 6, (num_kv_heads, head_dim), generator=gen).float())
        for _ in range(2)
    )
    return k.to(DEVICE), v.to(DEVICE)


def test_k8v16_scores_are_exact_int32_sums() -> None:
    # Query rows already on the int8 grid (amax 127: scale 1) against one key each (K scale 1):
    # every LSE is q.k times the softmax scale, sums up to 128 * 127**2, to float32 rounding
    # of the LSE's own log2/ln2 conversions (a 16-bit accumulation would be 2**-11 off).
    heads, dim = 2, 128
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (6, heads, dim), generator=gen).float()
    q[:, :, 0] = 127.0
    q[0, 0] = 127.0  # the largest sum: 128 * 127 * 127
    keys = torch.randint(-127, 128, (6, 1, heads, dim), generator=gen).to(torch.int8)
    keys[0, 0, 0] = 127
    k_scale = torch.ones(6, 1, heads)
    v_cache = torch.zeros(keys.shape)  # k8v16: V in q's dtype
    table = torch.arange(6, dtype=torch.int32).view(6, 1)
    cu = torch.arange(7, dtype=torch.int32)
    ones = torch.ones(6, dtype=torch.int32)
    _, lse = kernels.paged_attention(
        *(t.to(DEVICE) for t in (q, keys, v_cache, table, cu, ones)),
        max_seqlen_q=1,
        k_scale=k_scale.to(DEVICE),
        softmax_scale=2.0**-10,
        return_lse=True,
    )
    exact = torch.einsum("qhd,qhd->qh", q.double(), keys[:, 0].double())
    assert exact[0, 0] == 128 * 127 * 127
    torch.testing.assert_close(lse.cpu().double(), exact * 2.0**-10, rtol=2.0**-21, atol=0)


MODES = [pytest.param(torch.int8, "dequant", id="int8-dequant")]


@pytest.mark.parametrize("dtype, mode", MODES)
def test_equalizers_fold_into_q_and_the_output(dtype: torch.dtype, mode: str) -> None:
    # The pools hold rows divided by the factors; with them, every mode computes attention over
    # the undivided rows (its emulation with the same factors), and without them something else.
    case = make_paged_case(q_lens=[9, 4], k_lens=[41, 17], block_size=7, head_dim=80, device=DEVICE)
    k_factor, v_factor = factors(2, 80, seed=1)
    case.k_cache /= k_factor  # stored divided, as write_slots divides them (NaN stays NaN)
    case.v_cache /= v_factor
    args, scales = quantized_args(case, dtype, spread=0.5)
    got, lse = kernels.paged_attention(
        *args,
        **scales,
        k_equalizer=k_factor,
        v_equalizer=v_factor,
        out=nan_like(case.q),
        block_m=16,
        block_n=32,
        return_lse=True,
    )
    # The LSE is of the scores the kernel used: q times K's factors (exact: powers of two).
    group = case.q.shape[1] // k_factor.shape[0]
    q_rows = case.q.cpu() * k_factor.cpu().repeat_interleave(group, dim=0)
    want_lse = oracle((q_rows.to(DEVICE), *args[1:]), scales, return_lse=True)[1]
    assert_lse_close(lse, want_lse, LSE_RTOL)
    emulated = emulate(args, scales, mode, k_factor=k_factor, v_factor=v_factor)
    error = (got.double().cpu() - emulated).abs().max().item()
    limit = FP32_ATOL * max(1.0, emulated.abs().max().item())
    assert error <= limit, f"{error:.3e} > {limit:.3e}"
    unfolded = kernels.paged_attention(*args, **scales, block_m=16, block_n=32)
    assert (unfolded.double().cpu() - emulated).abs().max().item() > 10 * limit


def _v_scales_over_decades(
    dtype: torch.dtype, block_n: int, second_exponent: float | None = None
) -> tuple:
    """``(case, args, scales)``: two sequences over blocks of 16 whose V scales are multiplied,
    tile of ``block_n`` keys by tile, by 10**30, 10**-30, 10**20, 10**-25, 1, ... (the second
    sequence's all by ``10**second_exponent`` when given)."""
    case = make_paged_case(
        q_lens=[6, 5], k_lens=[6 * block_n, 3 * block_n + 4], block_size=16, device=DEVICE
    )
    args, scales = quantized_args(case, dtype, spread=0.5)
    exponents = torch.tensor([30.0, -30.0, 20.0, -25.0, 0.0, 30.0, -30.0])
    v_scale = scales["v_scale"].clone()
    for row, length in enumerate(case.seq_lens_k.tolist()):
        for key in range(length):
            block = int(case.block_table[row, key // 16])
            tile = exponents[(key // block_n) % len(exponents)]
            if row == 1 and second_exponent is not None:
                tile = second_exponent
            v_scale[block, key % 16] *= 10.0**tile
    return case, args, {**scales, "v_scale": v_scale}


@pytest.mark.parametrize(
    "dtype, modes",
    [
        pytest.param(torch.int8, {}, id="int8"),
    ],
)
def test_float16_operands_over_v_scales_from_1e_30_to_1e30(dtype: torch.dtype, modes: dict) -> None:
    # The 16-bit P V takes float16 operands, V's rows (the probabilities in masked tiles) times
    # their scales in the sequence's unit (its largest V scale * 448 / 2**15). Sequence 0's V
    # scales span 60 decades across key tiles (not in the unit, its 1e30 tiles overflow
    # float16), sequence 1's are all 1e-12 (not in the unit, they vanish in float16's range).
    # bf16 queries (the GPU runs float16 operands under them; the interpreter, float32 ones):
    # each query's output within bf16's rounding of its magnitude.
    block_n = 32
    case, args, scales = _v_scales_over_decades(dtype, block_n, second_exponent=-12.0)
    q = case.q.bfloat16()
    args = (q, *args[1:])
    got = kernels.paged_attention(
        *args, **scales, **modes, out=nan_like(q), block_m=16, block_n=block_n
    )
    assert torch.isfinite(got).all()
    want = oracle(args, scales).cpu()
    magnitude = want.abs().amax(dim=(1, 2), keepdim=True)  # per query: its largest output
    assert magnitude[:6].min() > 1e25 and 0 < magnitude[6:].max() < 1e-8
    error = ((got.double().cpu() - want).abs() / magnitude).max().item()
    assert error <= 1e-2, error


def test_torch_path_equalizers(no_interpreter) -> None:  # noqa: F811
    case = make_paged_case(q_lens=[5, 12], k_lens=[30, 12], block_size=7, head_dim=80)
    key_gap = torch.tensor([[2, 11], [1, 3]], dtype=torch.int32)
    args, scales = quantized_args(case, torch.int8)
    k_factor, v_factor = factors(2, 80, seed=2)
    got, lse = kernels.paged_attention(
        *args,
        **scales,
        key_gap=key_gap,
        k_equalizer=k_factor,
        v_equalizer=v_factor,
        return_lse=True,
    )
    emulated = emulate(
        args, scales, "dequant", key_gap=key_gap, k_factor=k_factor, v_factor=v_factor
    )
    torch.testing.assert_close(got.double(), emulated, atol=FP32_ATOL * 40, rtol=1e-5)
    # The LSE of the scores used: the rows of q times K's factors.
    q_rows = case.q * k_factor.repeat_interleave(2, dim=0)
    want_lse = oracle((q_rows, *args[1:]), scales, return_lse=True, key_gap=key_gap)[1]
    assert_lse_close(lse, want_lse, LSE_RTOL)


def test_8bit_mma_tiles(monkeypatch) -> None:
    # The 8-bit MMAs reduce over 32 channels at least. On a GPU the dequantizing mode takes a
    # stage more than the table's.
    small = dict(block_size=16, head_dim=16, max_seqlen_q=64, dtype=torch.bfloat16)
    assert choose_tiles(**small, k8v16=True)["BLOCK_D"] == 32
    assert choose_tiles(**small, k8v8=True)["BLOCK_D"] == 32
    assert choose_tiles(**small)["BLOCK_D"] == 16
    monkeypatch.setattr(launcher, "interpreter_active", lambda: False)
    shipped = dict(block_size=16, head_dim=128, max_seqlen_q=4680, dtype=torch.bfloat16)
    plain = choose_tiles(**shipped)["num_stages"]
    assert choose_tiles(**shipped, dequantize=True)["num_stages"] == plain + 1


def test_k8v8_tiles_take_32_keys_at_least(monkeypatch) -> None:
    # The FP8 P V MMA reduces over the tile's keys: Hopper's FP8 wgmma needs 32 (a 16-key tile
    # compiled on an H200 fails; the interpreter would run it). Asked for: refused; by default:
    # at least 32 everywhere.
    small = dict(block_size=16, head_dim=16, max_seqlen_q=64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_n must be >= 32 with k8v8, got 16"):
        choose_tiles(**small, k8v8=True, block_n=16)
    assert choose_tiles(**small, block_n=16)["BLOCK_N"] == 16  # the other modes keep 16
    monkeypatch.setattr(launcher, "interpreter_active", lambda: False)
    for head_dim in (64, 80, 128, 256):
        for max_seqlen_q in (1, 4680):
            tiles = choose_tiles(
                block_size=16,
                head_dim=head_dim,
                max_seqlen_q=max_seqlen_q,
                dtype=torch.bfloat16,
                k8v8=True,
            )
            assert tiles["BLOCK_N"] >= 32, (head_dim, max_seqlen_q)


def _bad_calls():
    return [
        pytest.param(  # the deleted e4m3 pool: e4m3 codes with a scale per slot (issue 45)
            torch.float8_e4m3fn,
            {},
            ValueError,
            r"k_cache=torch.float8_e4m3fn \(the e4m3 dequantizing pool\) was deleted"
            r'.*"k8v16".*"k8v8"',
            id="e4m3-pool",
        ),
        pytest.param(
            torch.int8,
            {"int8_mma": True},
            ValueError,
            'int8_mma was deleted.*"k8v16"',
            id="int8-mma",
        ),
        pytest.param(torch.int8, {"fp8_mma": 1}, ValueError, "fp8_mma was deleted", id="fp8-mma"),
        pytest.param(
            torch.int8,
            {"k_equalizer": torch.ones(2, 8)},
            ValueError,
            "k_equalizer must have shape",
            id="k-equalizer-shape",
        ),
        pytest.param(
            torch.int8,
            {"v_equalizer": torch.ones(2, 16, dtype=torch.float64)},
            TypeError,
            "v_equalizer",
            id="v-equalizer-dtype",
        ),
        pytest.param(
            None,
            {"k_equalizer": torch.ones(2, 16)},
            ValueError,
            "k_equalizer is only for quantized caches",
            id="float-caches",
        ),
    ]


@pytest.mark.parametrize("dtype, extra, error, words", _bad_calls())
def test_rejects_and_writes_nothing(dtype, extra, error, words) -> None:
    case = make_paged_case(q_lens=[4], k_lens=[9], block_size=8, head_dim=16)
    if dtype is None:
        args, scales = case.args(), {"max_seqlen_q": 4}
    else:
        args, scales = quantized_args(case, dtype)
    sentinel = torch.full_like(case.q, 7.0)
    extra = {k: v.to(case.q.device) if isinstance(v, Tensor) else v for k, v in extra.items()}
    with pytest.raises(error, match=words):
        kernels.paged_attention(*args, **scales, **extra, out=sentinel)
    assert torch.equal(sentinel, torch.full_like(sentinel, 7.0)), "a rejected call wrote out"
