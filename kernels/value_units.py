"""The probability unit of quantized attention per (sequence, KV head): the largest V scale among
the sequence's keys outside its gaps, / the largest value it takes in the unit, made before the
attention kernel, which loads it.

The kernel multiplies the attention's V side by the keys' V scales in this unit, so the ``P V``
operands never overflow and keep their precision whatever the scales' magnitude. The dequantizing
modes take float16 operands: V's rows times their scales in unmasked tiles,
the probabilities times them in masked ones, the largest scale 2**15 / 448 units (no e4m3 code times
its scale over 2**15; float16 holds 65504), so a scale keeps all 11 bits down to about 2**-20 of the
largest. With a fixed unit the key loop takes no tile maximum of the V scales: that maximum was
reduced across warps through shared memory and moved back to the MMA layout every tile (compiled for
sm_90a: 34-70 instructions per 64 keys and 1-3 barriers per tile; the accumulator was rescaled to
each new unit too).
Keys in a gap are left out (they may be unwritten slots holding anything), as are slots past
``seq_lens_k``; keys past a row's limit or the causal diagonal count (they hold written rows).
The unit is at least float32's smallest normal, so a sequence of zero rows gets a finite one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_video.kernels._quantize_jit import E4M3_MAX

# The largest V scale in the unit for float16 operands: 2**15 / 448 (no e4m3 code times its
# scale over 2**15, with float16's range, 65504, above it for the roundings).
FLOAT16_LARGEST = 2.0**15 / E4M3_MAX.value
SMALLEST_NORMAL = tl.constexpr(1.1754943508222875e-38)
# Keys per step: a sequence's scales are read in chunks of this many (a table entry each), so
# that the shipped window (28,080 keys) takes 7 steps of independent loads, not 28.
CHUNK = 4096


@triton.heuristics({"HAS_KEY_GAP": lambda args: args["key_gap_ptr"] is not None})
@triton.jit
def _probability_unit_kernel(
    v_scale_ptr,
    block_table_ptr,
    seq_lens_k_ptr,
    key_gap_ptr,
    unit_ptr,
    gaps_per_row,
    stride_vs_block,
    stride_vs_slot,
    stride_vs_head,
    stride_table_row,
    stride_table_col,
    stride_unit_seq,
    stride_unit_head,
    LARGEST: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,
    GAPS: tl.constexpr,
    HAS_KEY_GAP: tl.constexpr,
):
    """Program (i, h): sequence i's unit for KV head h."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    k_len = tl.load(seq_lens_k_ptr + seq)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_table_row
    scales = v_scale_ptr + kv_head.to(tl.int64) * stride_vs_head
    if HAS_KEY_GAP:
        # Missing gaps load as the empty [0, 0).
        offs_g = tl.arange(0, GAPS)
        gap_row = key_gap_ptr + seq * 2 * gaps_per_row + 2 * offs_g
        gap_lo = tl.load(gap_row, mask=offs_g < gaps_per_row, other=0)
        gap_hi = tl.load(gap_row + 1, mask=offs_g < gaps_per_row, other=0)
    largest = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, k_len, CHUNK):
        keys = start + tl.arange(0, CHUNK)
        shown = keys < k_len
        if HAS_KEY_GAP:
            hidden = (keys[:, None] >= gap_lo[None, :]) & (keys[:, None] < gap_hi[None, :])
            shown = shown & (tl.max(hidden.to(tl.int32), axis=1) == 0)
        block = tl.load(table_row + (keys // BLOCK_SIZE) * stride_table_col, mask=shown, other=0)
        scale = tl.load(
            scales + block.to(tl.int64) * stride_vs_block + (keys % BLOCK_SIZE) * stride_vs_slot,
            mask=shown,
            other=0.0,
        )
        largest = tl.maximum(largest, scale)
    unit = tl.maximum(tl.max(largest, axis=0) / LARGEST, SMALLEST_NORMAL)
    tl.store(unit_ptr + seq * stride_unit_seq + kv_head * stride_unit_head, unit)


def probability_units(
    v_scale: Tensor,
    block_table: Tensor,
    seq_lens_k: Tensor,
    key_gap: Tensor | None,
    *,
    largest: float,
) -> Tensor:
    """Float32 ``(batch, num_kv_heads)`` units for a quantized ``paged_attention``'s arguments
    (``key_gap`` as ``(batch, gaps, 2)``, contiguous, or None): each the largest V scale /
    ``largest`` (``FLOAT16_LARGEST`` for float16 operands).
    The launcher's checks have run: nothing is checked here."""
    batch = block_table.shape[0]
    _, block_size, kv_heads = v_scale.shape
    units = torch.empty((batch, kv_heads), dtype=torch.float32, device=v_scale.device)
    gaps_per_row = 1 if key_gap is None else key_gap.shape[1]
    _probability_unit_kernel[(batch, kv_heads)](
        v_scale,
        block_table,
        seq_lens_k,
        key_gap,
        units,
        gaps_per_row,
        *v_scale.stride(),
        *block_table.stride(),
        *units.stride(),
        LARGEST=largest,
        BLOCK_SIZE=block_size,
        CHUNK=CHUNK,
        GAPS=max(1, triton.next_power_of_2(gaps_per_row)),
        num_warps=8,
    )
    return units
