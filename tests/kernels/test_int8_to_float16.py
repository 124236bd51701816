"""The PTX that converts int8 codes to float16 on a GPU (``INT8_TO_FLOAT16_PTX``), run here by
a small emulator of the instructions it uses.

No CPU runs PTX and the interpreter converts with ``.to`` instead, so without this test a wrong
selector or constant would surface only on a GPU (where ``tests/kernels`` runs it through the
attention's int8 tests). Every code is converted in each of the four byte positions.
"""

from __future__ import annotations

import numpy as np

from paged_video.kernels._quantize_jit import INT8_TO_FLOAT16_PTX


def _prmt(a: np.ndarray, b: np.ndarray, selector: int) -> np.ndarray:
    """``prmt.b32`` in its default mode: byte i of the result is byte ``selector``'s nibble i
    of {b:a} (a bytes 0-3, b bytes 4-7), sign-replicated when the nibble's bit 3 is set."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = pool[nibble & 7]
        if nibble & 8:
            byte = np.where(byte & 0x80, 0xFF, 0).astype(a.dtype)
        out |= byte << (8 * i)
    return out


def _halves(word: np.ndarray) -> np.ndarray:
    """A ``.b32`` register as its two float16 halves, low half first: shape (n, 2)."""
    return word.astype(np.uint32).view(np.float16).reshape(-1, 2)


def _run(ptx: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run ``ptx`` (the instructions it uses: mov, xor, prmt and sub.f16x2) over vectors of
    32-bit registers; returns every register."""
    regs = dict(inputs)

    def value(operand: str) -> np.ndarray:
        if operand in regs:
            return regs[operand]
        return np.full_like(next(iter(inputs.values())), int(operand, 0))

    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if line in ("", "{", "}") or line.startswith(".reg"):
            continue
        opcode, operands = line.split(None, 1)
        dest, *sources = [o.strip() for o in operands.split(",")]
        args = [value(s) for s in sources]
        if opcode == "mov.b32":
            result = args[0].copy()
        elif opcode == "xor.b32":
            result = args[0] ^ args[1]
        elif opcode == "prmt.b32":
            result = _prmt(args[0], args[1], int(sources[2], 0))
        elif opcode == "sub.f16x2":
            difference = _halves(args[0]).astype(np.float32) - _halves(args[1])
            result = difference.astype(np.float16).reshape(-1).view(np.uint32)
        else:
            raise AssertionError(f"the emulator does not know {opcode!r}: extend it")
        regs[dest] = result.astype(np.uint32)
    return regs


def test_every_code_converts_exactly_in_every_byte_position() -> None:
    codes = np.arange(-128, 128, dtype=np.int8)
    # Word w holds codes w, w+1, w+2, w+3 (mod 256) in bytes 0..3: every code in every byte.
    words = np.stack([np.roll(codes, -i) for i in range(4)], axis=1).copy().view(np.uint32)
    regs = _run(INT8_TO_FLOAT16_PTX.value, {"$2": words[:, 0]})
    got = np.concatenate([_halves(regs["$0"]), _halves(regs["$1"])], axis=1)
    want = np.stack([np.roll(codes, -i) for i in range(4)], axis=1).astype(np.float16)
    np.testing.assert_array_equal(got, want)
