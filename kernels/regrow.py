"""Regrowing a layer's equalization factors when later rows are many times wider.

A layer's factors (``kernels.equalize``) are chosen by its first write. Channels that grow
after it (the ``k-grows`` data kind: 4 K channels 100x wider from the second frame) then set
every later row's int8 scale, leaving the other channels a code or two (k8v8 4.8% rel L1,
k8v16 3.0%, against 3.8% and 0.71% with factors chosen from the grown rows). So every later
write of a layer with a cache's flag also computes the factors its own rows would choose, and
a KV head where one of them is ``2**REGROW_LOG2`` times the frozen one or more regrows (a
write of ``REGROW_MIN_ROWS`` rows or more):

1. its factors become the elementwise maximum of the frozen and the write's (so each channel's
   new factor is the old one times a power of two >= 1);
2. every code stored for that head (all slots of the pool, and of any staged copy) becomes
   ``round(code * old / new)``, ties to even, its slot's scale unchanged: the value it stands
   for, ``code * scale * factor``, is kept but for that rounding (the grown channels of the
   older rows lose ``log2(new / old)`` bits, as they would had the factors been chosen that way
   from the start);
3. the write then quantizes its rows with the new factors.

Everything runs on the device with no sync, in two launches: one program per KV head reads the
write's rows once, sums each channel's squares and applies the rule (the factors, the flag), and
the codes kernel's few programs per head read the flag and exit when it is off, so a write where
nothing grew costs one pass over its rows and a launch that does nothing. Heads decide alone, so
a rank holding some of the heads (Ulysses) regrows as one process does. The threshold keeps the
rows of an ordinary frame (whose factors move by one power of two at most) from requantizing the
layer; a write of a few rows (whose channels' widths are noise) never regrows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_video.kernels import _checks, equalize
from paged_video.kernels._quantize_jit import round_to_code_grid
from paged_video.kernels._runtime import interpreter_active, use_torch_path

# A write's factor this many powers of two above the frozen one, in any channel of a KV head,
# regrows that head (2: rows 8-32x wider at K's share of 1/2, 3-6x at V's share of 1).
REGROW_LOG2 = 2
# Fewer rows than this never regrow: a channel's root mean square over a few rows is noise
# (over 64 Gaussian rows it is within ~10%, so the factors chosen from them move by one power of
# two at most where nothing grew), and every regrowth costs the grown channels' older codes
# bits for good.
REGROW_MIN_ROWS = 64
# Programs per KV head of the codes' rescale (each loops over a share of the slots).
CODES_LANES = 32
FLOAT32_MAX = tl.constexpr(torch.finfo(torch.float32).max)
# x + ROUND_MAGIC - ROUND_MAGIC rounds a small float32 x to an integer, ties to even.
ROUND_MAGIC = tl.constexpr(1.5 * 2**23)
MAX_FACTOR_LOG2 = tl.constexpr(float(equalize.MAX_FACTOR_LOG2))


@triton.jit
def _regrow_rule_kernel(
    rows_ptr,
    smooth_ptr,
    slot_mapping_ptr,
    frozen_ptr,
    new_ptr,
    grown_ptr,
    num_tokens,
    head_dim,
    stride_row_tok,
    stride_row_head,
    stride_row_dim,
    stride_smooth_head,
    stride_smooth_dim,
    stride_factor_head,
    stride_factor_dim,
    SHARE: tl.constexpr,
    THRESHOLD: tl.constexpr,
    MIN_ROWS: tl.constexpr,
    HAS_SMOOTH: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (KV head): steps 1 and the flag in one launch. Over the rows with a slot, each
    channel's sum of squares of the finite values of ``rows - smooth`` (the rows read once,
    float32 sums in a fixed order), then ``equalize.choose_factors``' rule on them, then the
    head's regrowth: ``new`` factors and ``grown`` (0 or 1)."""
    head = tl.program_id(0)
    dim = tl.arange(0, BLOCK_D)
    dim_mask = dim < head_dim
    row_head = head.to(tl.int64) * stride_row_head + dim * stride_row_dim
    if HAS_SMOOTH:
        smooth_offsets = head * stride_smooth_head + dim * stride_smooth_dim
        mean = tl.load(smooth_ptr + smooth_offsets, mask=dim_mask, other=0.0)
    squares = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    counts = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.int32)
    rows_used = tl.zeros([BLOCK_T], dtype=tl.int32)
    for start in range(0, num_tokens, BLOCK_T):
        token = start + tl.arange(0, BLOCK_T)
        slot = tl.load(slot_mapping_ptr + token, mask=token < num_tokens, other=-1)
        rows_used += (slot >= 0).to(tl.int32)
        mask = (slot >= 0)[:, None] & dim_mask[None, :]
        offsets = token.to(tl.int64)[:, None] * stride_row_tok + row_head[None, :]
        x = tl.load(rows_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_SMOOTH:
            x = x - mean[None, :]
        # False for NaN (no comparison holds) and for infinities.
        finite = mask & (tl.abs(x) <= FLOAT32_MAX)
        x = tl.where(finite, x, 0.0)
        squares += x * x
        counts += finite.to(tl.int32)
    count = tl.sum(counts, axis=0)
    rms = tl.sqrt(tl.sum(squares, axis=0) / tl.maximum(count, 1).to(tl.float32))
    # The head's median channel, the lower middle one as torch.median's: padding sorts last.
    ranked = tl.sort(tl.where(dim_mask, rms, float("inf")))
    # (Broadcast over the channels: the interpreter cannot combine a scalar's bool with a block.)
    median = tl.sum(tl.where(dim == (head_dim - 1) // 2, ranked, 0.0), axis=0) + 0.0 * rms
    # Where the ratio is not a finite positive quotient (a zero or overflowed channel, a zero
    # median) the exponent is 0, as the plain path's non-finite log2 gives.
    usable = (rms > 0.0) & (rms <= FLOAT32_MAX) & (median > 0.0) & (median <= FLOAT32_MAX)
    usable = usable & (count > 0)
    ratio = tl.log2(tl.where(usable, rms, 1.0) / tl.where(usable, median, 1.0))
    # Rounded half to even (as torch.round), then 2**exponent built exactly from its bits.
    exponent = (SHARE * ratio + ROUND_MAGIC) - ROUND_MAGIC
    exponent = tl.minimum(tl.maximum(tl.where(usable, exponent, 0.0), 0.0), MAX_FACTOR_LOG2)
    candidate = ((exponent.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    factor = head * stride_factor_head + dim * stride_factor_dim
    frozen = tl.load(frozen_ptr + factor, mask=dim_mask, other=1.0)
    wider = dim_mask & (candidate >= frozen * THRESHOLD)
    enough = (tl.sum(rows_used, axis=0) >= MIN_ROWS).to(tl.int32)
    grown = tl.max(wider.to(tl.int32), axis=0) * enough
    new = tl.where(grown != 0, tl.maximum(frozen, candidate), frozen)
    tl.store(new_ptr + factor, new, mask=dim_mask)
    tl.store(grown_ptr + head, grown.to(tl.int8))


def regrown_factors(
    frozen: Tensor, rows: Tensor, smooth: Tensor | None, slot_mapping: Tensor, share: float
) -> tuple[Tensor, Tensor]:
    """``(new factors (heads, head_dim), grown (heads,) bool)``: the rule above for the rows
    ``(tokens, heads, head_dim)`` with a slot (minus ``smooth``) against ``frozen``; one launch
    on a GPU. Rows past ``slot_mapping``'s length have no slot (as ``write_slots`` reads them)."""
    slot_mapping = _checks.contiguous_index(slot_mapping)  # the kernel reads it as ptr + t
    rows = rows[: slot_mapping.shape[0]]
    num_tokens, heads, head_dim = rows.shape
    if use_torch_path(rows):
        used = slot_mapping[:num_tokens] >= 0
        candidate = equalize.choose_factors(rows, smooth, used, share)
        wider = (candidate >= frozen * 2.0**REGROW_LOG2).any(dim=-1)
        grown = wider & (used.sum() >= REGROW_MIN_ROWS)
        return torch.where(grown[:, None], torch.maximum(frozen, candidate), frozen), grown
    new = torch.empty(heads, head_dim, dtype=frozen.dtype, device=frozen.device)
    grown = torch.empty(heads, dtype=torch.int8, device=rows.device)
    _regrow_rule_kernel[(heads,)](
        rows,
        rows if smooth is None else smooth,  # a placeholder, never read without HAS_SMOOTH
        slot_mapping,
        frozen,
        new,
        grown,
        num_tokens,
        head_dim,
        *rows.stride(),
        *((0, 0) if smooth is None else smooth.stride()),
        *frozen.stride(),
        SHARE=share,
        THRESHOLD=2.0**REGROW_LOG2,
        MIN_ROWS=REGROW_MIN_ROWS,
        HAS_SMOOTH=smooth is not None,
        # The interpreter pays per step, a GPU per register: few long steps there.
        BLOCK_T=128 if interpreter_active() else 16,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return new, grown.view(torch.bool)


@triton.jit
def _regrow_codes_kernel(
    codes_ptr,
    old_ptr,
    new_ptr,
    grown_ptr,
    num_slots,
    block_size,
    head_dim,
    stride_block,
    stride_slot,
    stride_head,
    stride_dim,
    stride_factor_head,
    stride_factor_dim,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (KV head, lane): if the head grew, the codes of every ``BLOCK_T``-slot tile
    ``lane, lane + lanes, ...`` of that head times ``old / new`` per channel, rounded to integers
    (ties to even). A few lanes a head, so a write where nothing grew launches few programs."""
    head = tl.program_id(0)
    lane = tl.program_id(1)
    lanes = tl.num_programs(1)
    if tl.load(grown_ptr + head) != 0:
        dim = tl.arange(0, BLOCK_D)
        dim_mask = dim < head_dim
        factor = head.to(tl.int64) * stride_factor_head + dim * stride_factor_dim
        old = tl.load(old_ptr + factor, mask=dim_mask, other=1.0)
        new = tl.load(new_ptr + factor, mask=dim_mask, other=1.0)
        # old / new is a power of two <= 1: the product is exact, the rounding the one change.
        ratio = (old / new)[None, :]
        for first in range(lane * BLOCK_T, num_slots, lanes * BLOCK_T):
            slot = (first + tl.arange(0, BLOCK_T)).to(tl.int64)
            row = (
                slot // block_size * stride_block
                + slot % block_size * stride_slot
                + head.to(tl.int64) * stride_head
            )
            offsets = row[:, None] + dim[None, :] * stride_dim
            mask = (slot < num_slots)[:, None] & dim_mask[None, :]
            codes = tl.load(codes_ptr + offsets, mask=mask, other=0).to(tl.float32)
            rounded = round_to_code_grid(codes * ratio, IS_FP8=False)
            tl.store(codes_ptr + offsets, rounded.to(codes_ptr.dtype.element_ty), mask=mask)


def regrow_codes(codes: Tensor, old: Tensor, new: Tensor, grown: Tensor) -> None:
    """Step 2 in place: int8 ``codes`` ``(num_slots, heads, head_dim)`` or paged ``(num_blocks,
    block_size, heads, head_dim)`` in any layout, of a layer whose factors go from ``old`` to
    ``new`` (heads, head_dim) float32; only heads where ``grown`` (heads,) bool."""
    if codes.numel() == 0:
        return
    if use_torch_path(codes):
        # (heads, head_dim) broadcasts over the slots of either shape.
        rounded = torch.round(codes.to(torch.float32) * (old / new)).to(codes.dtype)
        codes.copy_(torch.where(grown[:, None], rounded, codes))
        return
    paged = codes.dim() == 4
    block_size = codes.shape[1] if paged else 1
    num_slots = codes.shape[0] * block_size
    stride_slot = codes.stride(1) if paged else 0
    heads, head_dim = codes.shape[-2:]
    block_t = 32
    # (One lane a head under the interpreter, which runs each program in turn.)
    lanes = 1 if interpreter_active() else min(triton.cdiv(num_slots, block_t), CODES_LANES)
    _regrow_codes_kernel[(heads, lanes)](
        codes,
        old,
        new,
        grown.view(torch.int8),
        num_slots,
        block_size,
        head_dim,
        codes.stride(0),
        stride_slot,
        *codes.stride()[-2:],
        *old.stride(),
        BLOCK_T=block_t,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def regrow(
    factor: Tensor,
    rows: Tensor,
    slot_mapping: Tensor,
    share: float,
    codes: tuple[Tensor, ...],
    smooth: Tensor | None = None,
) -> None:
    """Steps 1-2 for one of a layer's factors (K's or the int8 pool's V's): choose from
    ``rows`` (those with a slot), regrow every tensor of ``codes`` (the pool, staged copies),
    then update ``factor`` in place."""
    new, grown = regrown_factors(factor, rows, smooth, slot_mapping, share)
    for tensor in codes:
        regrow_codes(tensor, factor, new, grown)
    factor.copy_(new)
