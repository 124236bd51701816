"""``reference.eight_bit_attention``: each step rounds where and by how much the format says.

With every rounding off the emulation is float64 attention; each rounding, turned on alone,
moves the output by about what its precision predicts and no more; the codes round float32
quotients as ``write_slots`` does.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from paged_video.reference import dense_attention
from paged_video.reference import eight_bit_attention as eba
from paged_video.reference.quantize import quantize

E4M3 = torch.float8_e4m3fn
EXACT = eba.EightBitFormat(p_dtype=None, acc_bits=None, v_scales="none")


def bf16_normal(*shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(torch.bfloat16).to(torch.float32)


def rel_l1(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out - expected).abs().sum() / expected.abs().sum())


def random_codes(seed: int, num_q: int = 20, num_k: int = 200, heads: int = 4, kv: int = 2):
    """Int8 Q and K codes with random float32 scales (per 8 rows, per slot) and float64 V."""
    generator = torch.Generator().manual_seed(seed)
    dim = 48

    def codes(*shape: int) -> torch.Tensor:
        return torch.randint(-127, 128, shape, generator=generator).to(torch.int8)

    queries = eba.Codes(codes(num_q, heads, dim), torch.rand(3, heads, generator=generator) / 50)
    keys = eba.Codes(codes(num_k, kv, dim), torch.rand(num_k, kv, generator=generator) / 50)
    values = torch.randn(num_k, kv, dim, generator=generator, dtype=torch.float64)
    return queries, keys, values


def test_with_every_rounding_off_it_is_float64_attention_over_the_codes() -> None:
    queries, keys, values = random_codes(0)
    mask = torch.rand(20, 200, generator=torch.Generator().manual_seed(1)) < 0.7
    mask[3] = False  # a row that attends nothing gives zeros
    fmt = eba.EightBitFormat(
        p_dtype=None, acc_bits=52, v_scales="none", q_rows_per_scale=8, flush_tiles=2
    )
    out = eba.attend_codes(queries, keys, eba.Codes(values, torch.ones(2, 48)), fmt, mask=mask)
    q = queries.codes.double() * queries.scale.double().repeat_interleave(8, dim=0)[:20, :, None]
    k = keys.codes.double() * keys.scale.double()[..., None]
    expected = dense_attention(q, k, values, mask=mask)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert (out[3] == 0).all()


@pytest.mark.parametrize("v_scales", ["frozen", "block"])
def test_exact_p_and_accumulator_leave_only_v_codes(v_scales: str) -> None:
    """Per-channel V scales, applied in the epilogue or at each flush, change nothing beyond
    the V codes themselves (codes times scales in float64)."""
    q, k, v = (bf16_normal(n, 2, 64, seed=s) for s, n in ((0, 16), (1, 300), (2, 300)))
    v = v * torch.logspace(-3, 3, 300)[:, None, None]  # per-block scales that differ widely
    fmt = eba.EightBitFormat(
        p_dtype=None, acc_bits=None, v_scales=v_scales, v_keys_per_scale=128, flush_tiles=2
    )
    values = eba.quantize_values(v, fmt, first_write=300)
    keys = eba.quantize_keys(k, fmt)
    queries = eba.quantize_queries(q, fmt)
    out = eba.attend_codes(queries, keys, values, fmt)
    scale = values.scale.double()
    per_key = scale if v_scales == "frozen" else scale.repeat_interleave(128, dim=0)[:300]
    exact_v = eba.Codes(values.codes.double() * per_key, torch.ones(2, 64))
    expected = eba.attend_codes(queries, keys, exact_v, EXACT)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-14)


def test_int8_codes_round_the_float32_quotient_half_to_even() -> None:
    """amax 1.703125 gives the float32 scale s; 0.8515625 / s is 63.5 in float32 (a tie: 64)
    and 63.4999994 in float64 (63): the kernel divides in float32."""
    row = torch.zeros(1, 1, 64)
    row[0, 0, :3] = torch.tensor([1.703125, 0.8515625, -0.8515625])
    fmt = eba.EightBitFormat(q_rows_per_scale=1)
    codes, scale = eba.quantize_queries(row, fmt)
    assert scale.item() == torch.tensor(1.703125) / 127
    assert codes[0, 0, :3].tolist() == [127, 64, -64]
    float64_codes, _ = quantize(row, torch.int8)
    assert float64_codes[0, 0, 1].item() == 63  # the float64 quotient: why this test exists
    # 2.5 = 0.5 * 5 lands on an exact tie in both: to even.
    row[0, 0, :3] = torch.tensor([127 / 5, 0.5, 1.5])
    assert eba.quantize_queries(row, fmt).codes[0, 0, :3].tolist() == [127, 2, 8]


def test_query_and_key_scales_cover_their_blocks_of_rows_and_keys() -> None:
    q = bf16_normal(10, 3, 32, seed=3)
    q[4, 1] *= 100  # raises the scale of rows 4-7 of head 1 only
    fmt = eba.EightBitFormat(q_rows_per_scale=4, k_keys_per_scale=4, k_dtype=E4M3)
    codes, scale = eba.quantize_queries(q, fmt)
    assert scale.shape == (3, 3)
    expected = torch.stack([q[r : r + 4].abs().amax(dim=(0, 2)) for r in (0, 4, 8)]) / 448
    torch.testing.assert_close(scale, expected, rtol=0, atol=0)
    assert (codes.float().abs().amax(dim=-1)[4:8, 1] < 448).sum() == 3
    keys = eba.quantize_keys(q, fmt)
    torch.testing.assert_close(keys.scale, scale, rtol=0, atol=0)
    # Each value is within half an e4m3 step (relative 2**-4) of its code times the scale.
    back = keys.codes.double() * keys.scale.double().repeat_interleave(4, dim=0)[:10, :, None]
    normal = q.abs() >= 2**-6 * keys.scale.repeat_interleave(4, dim=0)[:10, :, None]
    error = (back - q.double()).abs() / q.double().abs()
    assert error[normal].max() <= 2**-4
    assert error[normal].max() > 2**-6  # it does round


def test_smoothing_and_factors_apply_before_the_key_codes() -> None:
    k = bf16_normal(40, 2, 32, seed=4) + 10
    smooth = torch.full((2, 32), 10.0)
    factor = torch.ones(2, 32)
    factor[:, 0] = 4
    fmt = eba.EightBitFormat()
    codes, scale = eba.quantize_keys(k, fmt, smooth=smooth, factor=factor)
    expected, expected_scale = quantize(k, torch.int8, smooth=smooth, factor=factor)
    torch.testing.assert_close(scale, expected_scale, rtol=0, atol=0)
    assert (codes.int() - expected.int()).abs().max() <= 1  # float32 vs float64 quotient ties


@pytest.mark.parametrize("k_dtype", [torch.int8, E4M3], ids=["int8", "e4m3"])
def test_unrounded_codes_are_the_quotients_the_codes_round(k_dtype: torch.dtype) -> None:
    """``rounded=False`` (``bench.eight_bit_choice``'s error budget) keeps the float32 quotient
    that rounding takes, under the same scales, for both operands of ``Q K^T``."""
    fmt = eba.EightBitFormat(k_dtype=k_dtype, q_rows_per_scale=4)
    k = bf16_normal(40, 2, 32, seed=9) + 3
    smooth = torch.full((2, 32), 3.0)
    factor = torch.ones(2, 32)
    factor[:, 5] = 8
    q = bf16_normal(12, 4, 32, seed=10)
    for rounded, exact in (
        (
            eba.quantize_keys(k, fmt, smooth=smooth, factor=factor),
            eba.quantize_keys(k, fmt, smooth=smooth, factor=factor, rounded=False),
        ),
        (eba.quantize_queries(q, fmt, factor), eba.quantize_queries(q, fmt, factor, rounded=False)),
    ):
        assert exact.codes.dtype == torch.float64
        assert torch.equal(exact.scale, rounded.scale)
        assert torch.equal(eba.round_codes(exact.codes, k_dtype), rounded.codes)
        assert not torch.equal(exact.codes, rounded.codes.to(torch.float64))


def test_frozen_value_scales_take_the_first_write_with_headroom_and_saturate_beyond() -> None:
    v = bf16_normal(100, 2, 16, seed=5)
    v[:, 1, 3] = 0.0
    v[60:] *= 100  # grows after the first write
    fmt = eba.EightBitFormat(v_headroom=16.0)
    codes, scale = eba.quantize_values(v, fmt, first_write=50)
    amax = v[:50].abs().amax(dim=0)
    expected = amax * 16 / 448
    expected[1, 3] = expected[1].max()  # a channel zero in the first write: the head's largest
    torch.testing.assert_close(scale, expected, rtol=0, atol=0)
    back = codes.double() * scale.double()
    grown = v[60:].double().abs() > 448 * scale.double()
    assert grown.any()
    torch.testing.assert_close(
        back[60:].abs()[grown], (448 * scale.double()).expand_as(back[60:])[grown]
    )
    first = (back[:50] - v[:50].double()).abs()
    assert (first <= scale.double() * 2**-3 + v[:50].double().abs() * 2**-4).all()
    with pytest.raises(ValueError, match="first_write"):
        eba.quantize_values(v, fmt)


def test_probability_rounding_moves_the_output_by_e4m3s_precision() -> None:
    """Rounding P to e4m3 alone: each P off by at most 2**-4 relative, so the output by at most
    2**-4 of sum(P |v|) / sum(P); independent errors of RMS 2**-4 / sqrt(3) (uniform in half a
    step; a log-uniform mantissa makes it ~0.72 of that) add up to that RMS times
    sqrt(sum(P**2 v**2)) / sum(P)."""
    q, k, v = (bf16_normal(n, 1, 64, seed=s) for s, n in ((6, 32), (7, 512), (8, 512)))
    fmt = eba.EightBitFormat(acc_bits=None, v_scales="none")
    queries, keys = eba.quantize_queries(q, fmt), eba.quantize_keys(k, fmt)
    values = eba.Codes(v.double(), torch.ones(1, 64))
    exact = eba.attend_codes(queries, keys, values, EXACT)
    rounded = eba.attend_codes(queries, keys, values, fmt)
    abs_exact = eba.attend_codes(queries, keys, eba.Codes(v.double().abs(), values.scale), EXACT)
    assert ((rounded - exact).abs() <= 2**-4 * abs_exact + 1e-12).all()
    q64 = queries.codes.double() * queries.scale.double()[:, :, None]
    k64 = keys.codes.double() * keys.scale.double()[..., None]
    probs = torch.softmax(torch.einsum("qhd,khd->hqk", q64, k64) / 8, dim=-1)
    spread = torch.einsum("hqk,khd->qhd", probs.square(), v.double().square()).sqrt()
    ratio = (rounded - exact).square().mean().sqrt() / spread.square().mean().sqrt()
    assert 0.5 < float(ratio) / (2**-4 / math.sqrt(3)) < 1.0


def test_the_rounded_normalizer_makes_a_constant_v_exact() -> None:
    q, k = bf16_normal(8, 1, 32, seed=9), bf16_normal(256, 1, 32, seed=10) * 3
    # 28 = 448 / 16: the frozen scale (headroom 16) is exactly 1, every code 28.
    constant = torch.full((256, 1, 32), 28.0)
    for normalizer, exact in (("rounded", True), ("unrounded", False)):
        fmt = eba.EightBitFormat(acc_bits=None, normalizer=normalizer)
        out = eba.eight_bit_attention(q, k, constant, fmt, first_write=256)
        assert bool(((out - 28).abs() < 1e-12).all()) == exact


def test_the_rounded_normalizer_is_summed_as_p_v_is() -> None:
    # k8v8's kernel sums the rounded P by its P V MMA, over a column of ones: the same k-steps,
    # truncations and flushes as a channel of V. A V of codes 16 (a power of two: truncation
    # commutes with it) then comes out exactly 16 through a 13-bit accumulator, flushed every
    # tile or every 4; summed exactly instead, the normalizer would miss by the truncations.
    q, k = bf16_normal(8, 1, 32, seed=9), bf16_normal(512, 1, 32, seed=10) * 3
    fmt = eba.EightBitFormat(acc_bits=eba.FP8_MMA_ACC_BITS, normalizer="rounded")
    queries, keys = eba.quantize_queries(q, fmt), eba.quantize_keys(k, fmt)
    values = eba.Codes(torch.full((512, 1, 32), 16.0), torch.ones(1, 32))
    for flush in (1, 4):
        flushed = dataclasses.replace(fmt, flush_tiles=flush)
        out = eba.attend_codes(queries, keys, values, flushed)
        assert torch.equal(out, torch.full_like(out, 16.0)), flush
    exact_sum = dataclasses.replace(fmt, acc_bits=None)
    weights_only = eba.attend_codes(queries, keys, values, exact_sum)
    assert torch.equal(weights_only, torch.full_like(out, 16.0))  # exact: both sums exact
    unrounded = dataclasses.replace(fmt, normalizer="unrounded")
    assert not torch.equal(eba.attend_codes(queries, keys, values, unrounded), out)


def test_truncation_keeps_the_mantissa_bits_toward_zero() -> None:
    x = torch.tensor(
        [1.0, 1 + 2**-13, 1 + 2**-14, -(1 + 2**-13 + 2**-14), 3.0, 0.0, -(2**-1000)],
        dtype=torch.float64,
    )
    out = eba.truncate_mantissa(x, 13)
    assert out.tolist() == [1.0, 1 + 2**-13, 1.0, -(1 + 2**-13), 3.0, 0.0, -(2**-1000)]
    y = torch.randn(1000, dtype=torch.float64)
    assert torch.equal(eba.truncate_mantissa(y, 52), y)


def test_the_accumulator_loses_what_its_bits_and_flushes_predict() -> None:
    """Truncating after each of n k-steps loses under n * 2**-bits of the running sum's
    magnitude; flushing every tile bounds n, flushing every 8 tiles lets it grow."""
    q, k, v = (bf16_normal(n, 1, 64, seed=s) for s, n in ((11, 16), (12, 2048), (13, 2048)))
    v = v + 2  # a mean, so the running sums grow with the keys
    base = eba.EightBitFormat(acc_bits=None)
    exact = eba.eight_bit_attention(q, k, v, base, first_write=2048)
    errors = {}
    for bits, flush in ((13, 1), (13, 8), (22, 8)):
        fmt = eba.EightBitFormat(acc_bits=bits, flush_tiles=flush)
        out = eba.eight_bit_attention(q, k, v, fmt, first_write=2048)
        errors[bits, flush] = rel_l1(out, exact)
        steps = flush * 64 // 32
        assert 0 < errors[bits, flush] < steps * 2.0**-bits
    assert errors[13, 8] > 2 * errors[13, 1]
    assert errors[22, 8] < errors[13, 8] / 100


def test_block_value_scales_need_flushes_inside_a_block() -> None:
    with pytest.raises(ValueError, match="v_keys_per_scale"):
        eba.EightBitFormat(v_scales="block", v_keys_per_scale=64, flush_tiles=2)
    with pytest.raises(ValueError, match="p_dtype"):
        eba.EightBitFormat(p_dtype=torch.float16)
    with pytest.raises(TypeError, match="k_dtype"):
        eba.EightBitFormat(k_dtype=torch.float16)


def test_e4m3_scores_go_through_the_accumulator() -> None:
    """e4m3 Q K^T sums 32 channels per k-step in the MMA's accumulator: at 52 bits the scores
    are exact, at 3 bits they are not."""
    q, k, v = (bf16_normal(n, 1, 128, seed=s) for s, n in ((14, 8), (15, 64), (16, 64)))
    outs = {
        bits: eba.eight_bit_attention(
            q, k, v, eba.EightBitFormat(k_dtype=E4M3, acc_bits=bits, p_dtype=None), first_write=64
        )
        for bits in (None, 52, 3)
    }
    torch.testing.assert_close(outs[52], outs[None], rtol=0, atol=1e-13)
    assert rel_l1(outs[3], outs[None]) > 1e-3


@pytest.mark.parametrize(
    ("v_scales", "keys_per_scale", "passes"),
    [("block", 64, True), ("block", 256, False), ("frozen", 64, False), ("slot", 64, False)],
)
def test_small_v_scales_on_the_keys_with_the_mass_pass_only_in_their_own_block(
    v_scales: str, keys_per_scale: int, passes: bool
) -> None:
    """Issue 46 item 3: 1024 keys, the first 64 with V times 1e-6 and K aligned with q (they
    carry all the mass). e4m3 spans 448 / 2**-9 (2.3e5): a scale shared with V's normal keys,
    or today's probabilities times V scales in the largest's unit, underflows every code to 0;
    a block of 64 keys of their own keeps them (int8 K per slot: 5.2% here)."""
    generator = torch.Generator().manual_seed(0)
    direction = torch.randn(1, 128, generator=generator)
    q = torch.randn(16, 1, 128, generator=generator) / 2 + direction
    k = torch.randn(1024, 1, 128, generator=generator)
    k[:64] = k[:64] / 2 + 4 * direction
    v = torch.randn(1024, 1, 128, generator=generator)
    v[:64] *= 1e-6
    q, k, v = (x.to(torch.bfloat16).to(torch.float32) for x in (q, k, v))
    expected = dense_attention(q.double(), k.double(), v.double())
    fmt = eba.EightBitFormat(v_scales=v_scales, v_keys_per_scale=keys_per_scale)
    out = eba.eight_bit_attention(q, k, v, fmt, first_write=1024)
    if passes:
        assert rel_l1(out, expected) < 0.08
    else:
        assert (out == 0).all()


@pytest.mark.parametrize("v_scales", eba.V_SCALES)
@pytest.mark.parametrize("k_dtype", [torch.int8, E4M3])
def test_the_emulation_runs_on_the_inputs_device(v_scales: str, k_dtype: torch.dtype) -> None:
    # `bench accuracy` emulates on the data's device (a GPU's, in the GPU check): a tensor the
    # emulation makes on the CPU meets the inputs there. The meta device stands in for it.
    q, k, v = (
        torch.empty(*shape, device="meta") for shape in ((8, 2, 32), (70, 1, 32), (70, 1, 32))
    )
    fmt = eba.EightBitFormat(k_dtype=k_dtype, v_scales=v_scales, flush_tiles=1, tile_keys=32)
    smooth, factor = torch.zeros(1, 32, device="meta"), torch.ones(1, 32, device="meta")
    out = eba.eight_bit_attention(q, k, v, fmt, first_write=16, smooth=smooth, k_factor=factor)
    assert out.device.type == "meta" and out.shape == (8, 2, 32)


@pytest.mark.parametrize("rows_per_scale", [1, 8])
def test_attending_by_rows_gives_one_calls_output(rows_per_scale: int) -> None:
    # Query blocks of 16 rows, each with the scales of its own rows (per row, or per 8 rows):
    # every row as one call gives it; a block that splits a query scale is refused.
    fmt = eba.EightBitFormat(q_rows_per_scale=rows_per_scale, v_scales="none", p_dtype=None)
    q = bf16_normal(40, 4, 48, seed=3)
    k, v = bf16_normal(200, 2, 48, seed=4), bf16_normal(200, 2, 48, seed=5)
    queries, keys = eba.quantize_queries(q, fmt, None), eba.quantize_keys(k, fmt)
    values = eba.quantize_values(v, fmt)
    whole = eba.attend_codes(queries, keys, values, fmt)
    by_rows = eba.attend_codes_by_rows(queries, keys, values, fmt, 16)
    assert torch.equal(by_rows, whole)
    with pytest.raises(ValueError, match="rows_per_call"):
        eba.attend_codes_by_rows(queries, keys, values, fmt, 12 if rows_per_scale == 8 else 0)
