"""vllm-omni-shaped AR-Diffusion attention inputs, and their float64 expectation."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from paged_video import reference

FP32_ATOL = 2e-5
FP16_ATOL = 3e-3


@dataclass
class ARCase:
    """One forward as vllm-omni 0.30.0 builds it: the visible history chunks, then the current
    chunk, then the action tokens in scratch blocks, one sequence whose block table is padded
    with the null block 0 to a fixed width (``max_seq_len``); every pool slot it does not
    write is NaN, and its blocks are a permutation of the pool's."""

    query: Tensor
    key_cache: Tensor
    value_cache: Tensor
    block_table: Tensor
    query_start_loc: Tensor
    seq_lens: Tensor
    max_query_len: int
    max_seq_len: int
    softmax_scale: float
    current_tokens: int
    history_blocks: int

    def kwargs(self) -> dict[str, object]:
        return {
            "block_table": self.block_table,
            "query_start_loc": self.query_start_loc,
            "seq_lens": self.seq_lens,
            "max_query_len": self.max_query_len,
            "max_seq_len": self.max_seq_len,
            "softmax_scale": self.softmax_scale,
        }

    def expected(self, *, causal: bool = False) -> Tensor:
        """Float64 ``(T, H, D)`` attention of the query over the sequence's keys."""
        return reference.paged_attention(
            self.query.reshape(-1, *self.query.shape[-2:]),
            self.key_cache,
            self.value_cache,
            self.block_table,
            self.query_start_loc,
            self.seq_lens,
            max_seqlen_q=self.max_query_len,
            softmax_scale=self.softmax_scale,
            causal=causal,
        ).to(torch.float64)


def ar_case(
    *,
    block_size: int,
    history_chunks: int,
    action_len: int = 0,
    chunk_blocks: int = 1,
    window_chunks: int = 4,
    heads: int = 2,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    query_len: int | None = None,
    batched: bool = False,
    seed: int = 0,
) -> ARCase:
    """``query_len`` overrides the query rows (default: the current chunk plus the actions)."""
    gen = torch.Generator().manual_seed(seed)
    chunk = chunk_blocks * block_size
    video_blocks = (history_chunks + 1) * chunk_blocks
    action_blocks = math.ceil(action_len / block_size)
    width = window_chunks * chunk_blocks + max(1, action_blocks)
    num_blocks = 1 + video_blocks + action_blocks + 2  # block 0 is the null block
    used = (torch.randperm(num_blocks - 1, generator=gen) + 1)[: video_blocks + action_blocks]
    table = torch.zeros(1, width, dtype=torch.int32)
    table[0, : used.numel()] = used.to(torch.int32)
    shape = (num_blocks, block_size, heads, head_dim)
    caches = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(2)]
    video_len = video_blocks * block_size
    for cache in caches:
        for position in range(video_len + action_len):
            if position < video_len:
                block, offset = used[position // block_size], position % block_size
            else:
                index = position - video_len
                block, offset = used[video_blocks + index // block_size], index % block_size
            cache[block, offset] = torch.randn(heads, head_dim, generator=gen).to(dtype)
    # The action rows follow the video rows in the table, so the attended sequence is the
    # video run and then the actions, as vllm-omni's table lays them out.
    seq_len = video_len + action_len
    rows = chunk + action_len if query_len is None else query_len
    query = torch.randn(rows, heads, head_dim, generator=gen).to(dtype)
    if batched:
        query = query.unsqueeze(0)
    return ARCase(
        query=query,
        key_cache=caches[0],
        value_cache=caches[1],
        block_table=table,
        query_start_loc=torch.tensor([0, rows], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        max_query_len=rows,
        max_seq_len=width * block_size,
        softmax_scale=head_dim**-0.5,
        current_tokens=chunk,
        history_blocks=history_chunks * chunk_blocks,
    )


def assert_matches(got: Tensor, want: Tensor) -> None:
    """``got`` (any float dtype) against the float64 expectation, at its dtype's tolerance."""
    assert not torch.isnan(got).any(), "NaN in the output: an unwritten row or a poisoned read"
    atol = FP32_ATOL if got.dtype == torch.float32 else FP16_ATOL
    got = got.reshape(want.shape).to(torch.float64)
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
