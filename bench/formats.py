"""One spelling per KV pool format on every command line: ``bf16``, ``int8``.

``bf16`` is the unquantized pool (the model's own dtype, so float32 in a float32 run: each
command prints the dtype it really used); ``int8`` holds codes with a float32 scale per
(slot, KV head). The quantized attention's providers follow the same names (``triton-int8``;
``triton-int8-keys``: over keys-major scales).

Attention over these pools has one mode, ``dequant`` (the codes converted exactly before
16-bit MMAs; ``bench accuracy``'s ``mode`` column names it). Their MMA modes, FP8-MMA and
INT8-MMA, were deleted (issue 45): k8v8 and k8v16 dominate them. So was the ``e4m3`` pool:
k8v16 is more accurate on every data kind, k8v8 stores the same bytes with fewer instructions
(``DELETED_E4M3``).

Spellings used before are refused with the new one named (``OLD_SPELLINGS``), so a script
fails loudly instead of silently running something else; results CSVs written before are
read with their provider names renamed (``bench.results.RENAMED_PROVIDERS``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection, Sequence

import torch

UNQUANTIZED = "bf16"
QUANTIZED_FORMATS: dict[str, torch.dtype] = {"int8": torch.int8}
DEQUANT = "dequant"
OLD_SPELLINGS = {
    "bfloat16": "bf16",
    # FP8-MMA was deleted (issue 45): k8v8 dominates it.
    "triton-fp8-mma": "triton-k8v8",
    "triton-e4m3-mma": "triton-k8v8",
    "triton-e4m3-mma-keys": "triton-k8v8",
    # INT8-MMA too: k8v16 dominates it.
    "triton-int8-mma": "triton-k8v16",
    "triton-int8-mma-keys": "triton-k8v16",
}
# The e4m3 dequantizing pool's spellings (deleted, issue 45): each is refused naming k8v16
# (more accurate on every data kind) and k8v8 (the same bytes).
DELETED_E4M3 = (
    "e4m3",
    "fp8",
    "fp8_keys",
    "float8_e4m3fn",
    "torch.float8_e4m3fn",
    "triton-e4m3",
    "triton-e4m3-keys",
    "triton-fp8",
)


def old_spelling(text: str, allowed: Collection[str]) -> str | None:
    """A one-line refusal of ``text`` when it is a spelling used before: a deleted format's
    (``DELETED_E4M3``), or one whose new spelling is in ``allowed``; None otherwise."""
    if text in DELETED_E4M3:
        prefix = "triton-" if text.startswith("triton-") else ""
        return (
            f"{text!r} (the e4m3 dequantizing pool) was deleted (issue 45): use {prefix}k8v16 "
            f"(more accurate on every data kind) or {prefix}k8v8 (the same bytes)"
        )
    new = OLD_SPELLINGS.get(text)
    if new is None or new not in allowed:
        return None
    return f"{text!r} is spelled {new!r} now (one spelling per format: bf16, int8, k8v8, k8v16)"


def choice(allowed: Sequence[str]) -> Callable[[str], str]:
    """An argparse ``type`` taking one of ``allowed``: anything else is refused in one line,
    a spelling used before with its new one named (``old_spelling``)."""

    def parse(text: str) -> str:
        if text not in allowed:
            refusal = old_spelling(text, allowed)
            raise argparse.ArgumentTypeError(
                refusal or f"{text!r} is not one of {', '.join(allowed)}"
            )
        return text

    return parse


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bf16``, ``torch.int8`` -> ``int8``, ``torch.float32`` ->
    ``fp32``: the names the command lines use."""
    names = {
        torch.bfloat16: "bf16",
        torch.float16: "fp16",
        torch.float32: "fp32",
        **{value: key for key, value in QUANTIZED_FORMATS.items()},
    }
    return names.get(dtype, str(dtype).removeprefix("torch."))
