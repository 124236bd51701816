"""Codes inside a Triton kernel: per-row scales and codes rounded explicitly to the grid, and
int8 codes converted to float16 for an MMA.

Shared by the quantized ``write_slots`` kernel and any kernel that quantizes a tile on the fly
(e.g. queries for an FP8 MMA). Rounding is done in float32 before the conversion, on every
backend: Triton's interpreter converts float32 to ``float8e4nv`` wrongly when rounding carries
into the next binade (31.2 -> 16, not 32), so the conversion is only ever given values that are
already codes, which every backend converts exactly. ``kernels.torch_path.round_to_code_grid``
is the same arithmetic in PyTorch.
"""

from __future__ import annotations

import triton
import triton.language as tl

# 1.5 * 2**23: (r + M) - M rounds a float32 |r| < 2**22 to an integer, nearest, ties to even,
# since M's ulp is 1; M * 2**k rounds to multiples of 2**k the same way.
ROUND_MAGIC = tl.constexpr(12582912.0)
# float32 biased exponent of e4m3's smallest normal (2**-6): below it the code step is 2**-9.
E4M3_MIN_NORMAL_EXP = tl.constexpr(127 - 6)
E4M3_MANTISSA_BITS = tl.constexpr(3)
# e4m3fn's largest finite code.
E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def round_to_code_grid(ratio, IS_FP8: tl.constexpr):
    """Round float32 ``ratio`` (already within +-QMAX) to the nearest code, ties to even.

    int8: the step is 1. e4m3: the step is ``2**(e - 3)`` for ``|ratio|`` in ``[2**e,
    2**(e+1))``, ``2**-9`` below the smallest normal; a value rounding up into the next binade
    lands on its first code, which is a multiple of the lower binade's step too.
    """
    if IS_FP8:
        exponent = (ratio.to(tl.int32, bitcast=True) >> 23) & 0xFF
        step_exponent = tl.maximum(exponent, E4M3_MIN_NORMAL_EXP) - E4M3_MANTISSA_BITS
        magic = (step_exponent << 23).to(tl.float32, bitcast=True) * ROUND_MAGIC
        rounded = (ratio + magic) - magic
        # A negative value rounding to zero comes out +0; e4m3 keeps the sign (-0), as a
        # direct conversion and the oracle do.
        rounded = tl.where(rounded == 0.0, ratio * 0.0, rounded)
    else:
        rounded = (ratio + ROUND_MAGIC) - ROUND_MAGIC
    return rounded


@triton.jit
def quantize_rows(x, QMAX: tl.constexpr, IS_FP8: tl.constexpr):
    """``(codes, scale)`` of float32 ``x [..., D]`` along its last axis.

    ``scale = amax(|x|) / QMAX``; codes are ``x / scale`` clamped to +-QMAX and rounded to the
    code grid, still float32 (convert them to the pool dtype: exact). A zero row gets scale 0
    and codes 0, never NaN. Masked-off lanes must hold 0 so they do not raise the amax. Both
    divisions round correctly (``div_rn``) so a GPU computes what the interpreter tested.
    """
    amax = tl.max(tl.abs(x), axis=-1)
    scale = tl.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
    positive = scale > 0
    divisor = tl.where(positive, scale, 1.0)
    ratio = tl.div_rn(x, tl.expand_dims(divisor, -1))
    ratio = tl.where(tl.expand_dims(positive, -1), ratio, 0.0)
    ratio = tl.minimum(tl.maximum(ratio, -QMAX), QMAX)
    return round_to_code_grid(ratio, IS_FP8), scale


@triton.jit
def to_e4m3(x, INTERPRETED: tl.constexpr):
    """Float32 ``x`` as the nearest e4m3 code (ties to even), saturating at +-448.

    On a GPU the conversion is one ``cvt.rn.satfinite`` per pair: rounding explicitly here, in
    the hot loop, would cost ~250 instructions per tile. The interpreter's conversion rounds
    wrongly when rounding carries into the next binade (31.2 -> 16), so there
    (``INTERPRETED``) x is first rounded to the code grid as the write kernel does
    (``round_to_code_grid``), and the result converts exactly.
    """
    if INTERPRETED:
        x = round_to_code_grid(tl.minimum(tl.maximum(x, -E4M3_MAX), E4M3_MAX), True)
    return x.to(tl.float8e4nv)


# int8 -> float16, four codes a 32-bit register: bias each byte to u = x + 128 (xor 0x80), set
# it as the low byte under exponent byte 0x64 (float16 1024 + u, exact: float16 has 10 mantissa
# bits), subtract 1152. Five instructions per four codes; Triton's own conversion of int8 to
# float16 takes an I2F each (and to bfloat16 four instructions a pair). $2 holds codes 0..3
# (code 0 in the low byte), $0 codes 0 and 1 (code 0 in the low half), $1 codes 2 and 3.
INT8_TO_FLOAT16_PTX = tl.constexpr("""
{
.reg .b32 biased, magic, offset;
mov.b32 magic, 0x64646464;
mov.b32 offset, 0x64806480;
xor.b32 biased, $2, 0x80808080;
prmt.b32 $0, biased, magic, 0x5140;
prmt.b32 $1, biased, magic, 0x5342;
sub.f16x2 $0, $0, offset;
sub.f16x2 $1, $1, offset;
}
""")


@triton.jit
def int8_to_float16(x, INTERPRETED: tl.constexpr):
    """int8 codes ``x`` as float16 (exact), by ``INT8_TO_FLOAT16_PTX``; the interpreter, which
    runs no PTX (``INTERPRETED``), converts them with ``.to``."""
    if INTERPRETED:
        return x.to(tl.float16)
    return tl.inline_asm_elementwise(
        INT8_TO_FLOAT16_PTX, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4
    )
