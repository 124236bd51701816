"""Builders for paged attention test cases: a NaN-poisoned pool, a block table, packed queries.

Every slot the block table does not point at (and every table padding entry's block) holds NaN,
so a kernel that reads one slot too many produces NaN and fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PagedCase:
    q: Tensor
    k_cache: Tensor
    v_cache: Tensor
    block_table: Tensor
    cu_seqlens_q: Tensor
    seq_lens_k: Tensor
    max_seqlen_q: int

    def args(self) -> tuple[Tensor, ...]:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_table,
            self.cu_seqlens_q,
            self.seq_lens_k,
        )


def make_paged_case(
    *,
    q_lens: list[int],
    k_lens: list[int],
    block_size: int,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    table_order: str = "permuted",
    spare_blocks: int = 3,
    padding_columns: int = 2,
    seed: int = 0,
) -> PagedCase:
    """A random case; ``table_order`` is ``"permuted"``, ``"sequential"`` or ``"repeated"``.

    ``"repeated"`` draws every table entry from three shared blocks (fully written), so one
    block appears several times in a row and in several rows.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_row = [math.ceil(length / block_size) for length in k_lens]
    repeated = table_order == "repeated"
    owned = min(3, max(blocks_per_row, default=0)) if repeated else sum(blocks_per_row)
    num_blocks = owned + spare_blocks + 1
    poison = num_blocks - 1  # padding entries point at a NaN block
    if table_order == "sequential":
        order = torch.arange(owned)
    else:
        order = torch.randperm(owned, generator=gen)
    width = max(blocks_per_row, default=0) + padding_columns
    table = torch.full((len(k_lens), max(width, 1)), poison, dtype=torch.int32)
    cursor = 0
    for row, count in enumerate(blocks_per_row):
        if repeated:
            picks = (torch.arange(count) * 2 + row) % owned
        else:
            picks = torch.arange(cursor, cursor + count)
            cursor += count
        table[row, :count] = order[picks].to(torch.int32)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    if repeated:
        # Which slots are read depends on the row; write the shared blocks whole.
        k_cache[:owned] = torch.randn(owned, *shape[1:], generator=gen).to(dtype)
        v_cache[:owned] = torch.randn(owned, *shape[1:], generator=gen).to(dtype)
    else:
        for row, length in enumerate(k_lens):
            positions = torch.arange(length)
            blocks = table[row, positions // block_size].long()
            slots = positions % block_size
            fresh = torch.randn(2, length, num_kv_heads, head_dim, generator=gen).to(dtype)
            k_cache[blocks, slots] = fresh[0]
            v_cache[blocks, slots] = fresh[1]

    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen).to(dtype)
    return PagedCase(
        q=q.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_table=table.to(device),
        cu_seqlens_q=cu.to(device),
        seq_lens_k=torch.tensor(k_lens, dtype=torch.int32, device=device),
        max_seqlen_q=max(max(q_lens, default=1), 1),
    )


def tolerance_anchor(
    case: PagedCase,
    reference_out: Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
) -> float:
    """Max error of the same attention done by PyTorch in the test dtype (flash-attn's anchor)."""
    from paged_video.reference.attention import attention_mask, gather_sequence

    dtype = case.q.dtype
    worst = 0.0
    starts = case.cu_seqlens_q.tolist()
    for i, k_len in enumerate(case.seq_lens_k.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo or k_len == 0:
            continue
        q = case.q[lo:hi].float().to(dtype)
        k = gather_sequence(case.k_cache, case.block_table[i], k_len)
        v = gather_sequence(case.v_cache, case.block_table[i], k_len)
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scale = softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        mask = attention_mask(hi - lo, k_len, causal=causal, device=q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(dtype)
        out = torch.einsum("hqk,khd->qhd", probs, v)
        worst = max(worst, (out.double() - reference_out[lo:hi].double()).abs().max().item())
    return worst


def assert_lse_close(got: Tensor, want: Tensor, rtol: float) -> None:
    """``got`` (a kernel's float32 LSE) against the float64 oracle's: ``-inf`` exactly where the
    oracle's row sees no key, elsewhere finite and within ``rtol`` of the largest magnitude."""
    assert got.dtype == torch.float32 and got.shape == want.shape, (got.dtype, got.shape)
    empty = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), empty), "a row with no visible key must give -inf"
    if empty.all():
        return
    assert torch.isfinite(got[~empty]).all(), "LSE left NaN or inf on a row that sees keys"
    error = (got.double() - want)[~empty].abs().max().item()
    limit = rtol * max(1.0, want[~empty].abs().max().item())
    assert error <= limit, f"LSE max error {error:.3e} > {limit:.3e}"
