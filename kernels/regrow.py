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

Everything runs on the device with no sync: the codes kernel reads the head's flag and leaves
the codes alone when it is off, so a write where nothing grew costs the candidate factors'
reduction and one launch whose programs exit at once. Heads decide alone, so a rank holding
some of the heads (Ulysses) regrows as one process does. The threshold keeps the rows of an
ordinary frame (whose factors move by one power of two at most) from requantizing the layer;
a write of a few rows (whose channels' widths are noise) never regrows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_video.kernels import equalize
from paged_video.kernels._quantize_jit import round_to_code_grid
from paged_video.kernels._runtime import use_torch_path

# A write's factor this many powers of two above the frozen one, in any channel of a KV head,
# regrows that head (2: rows 8-32x wider at K's share of 1/2, 3-6x at V's share of 1).
REGROW_LOG2 = 2
# Fewer rows than this never regrow: a channel's root mean square over a few rows is noise
# (over 64 Gaussian rows it is within ~10%, so the factors chosen from them move by one power of
# two at most where nothing grew), and every regrowth costs the grown channels' older codes
# bits for good.
REGROW_MIN_ROWS = 64


def regrown_factors(
    frozen: Tensor, rows: Tensor, smooth: Tensor | None, used: Tensor, share: float
) -> tuple[Tensor, Tensor]:
    """``(new factors (heads, head_dim), grown (heads,) bool)``: the rule above for the rows
    ``(tokens, heads, head_dim)`` (minus ``smooth``, where ``used``) against ``frozen``."""
    candidate = equalize.choose_factors(rows, smooth, used, share)
    grown = (candidate >= frozen * 2.0**REGROW_LOG2).any(dim=-1) & (used.sum() >= REGROW_MIN_ROWS)
    return torch.where(grown[:, None], torch.maximum(frozen, candidate), frozen), grown


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
    """Program (slot tile, KV head): the codes of ``BLOCK_T`` slots of one head times
    ``old / new`` per channel, rounded to integers (ties to even), if the head grew."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    if tl.load(grown_ptr + head) != 0:
        slot = (tile * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        dim = tl.arange(0, BLOCK_D)
        dim_mask = dim < head_dim
        factor = head.to(tl.int64) * stride_factor_head + dim * stride_factor_dim
        old = tl.load(old_ptr + factor, mask=dim_mask, other=1.0)
        new = tl.load(new_ptr + factor, mask=dim_mask, other=1.0)
        row = (
            slot // block_size * stride_block
            + slot % block_size * stride_slot
            + head.to(tl.int64) * stride_head
        )
        offsets = row[:, None] + dim[None, :] * stride_dim
        mask = (slot < num_slots)[:, None] & dim_mask[None, :]
        codes = tl.load(codes_ptr + offsets, mask=mask, other=0).to(tl.float32)
        # old / new is a power of two <= 1: the product is exact, the rounding the one change.
        rounded = round_to_code_grid(codes * (old / new)[None, :], IS_FP8=False)
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
    _regrow_codes_kernel[(triton.cdiv(num_slots, block_t), heads)](
        codes,
        old,
        new,
        grown.to(torch.int8),
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
    old = factor.clone()
    new, grown = regrown_factors(old, rows, smooth, slot_mapping >= 0, share)
    for tensor in codes:
        regrow_codes(tensor, old, new, grown)
    factor.copy_(new)
