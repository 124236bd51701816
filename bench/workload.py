"""Benchmark workloads: the paged K/V pool one forward of an AR video-diffusion model reads.

A forward's queries are ``frames`` chunks of ``chunk_size`` tokens; its keys are the sink plus the
recent window (the forward's own frames included), ``(sink_chunks + window_chunks) * chunk_size``
tokens per sequence. The keys live in a pool of blocks handed out in random order, as after a
long rollout. The key count does not depend on the block size, and neither does the data: the
logical q/K/V come from the seed alone, so every block size of a sweep computes the same
attention and one oracle result serves them all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from paged_video import reference
from paged_video.reference.attention import gather_sequence

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}

# Bytes of float64 scores one oracle call may hold; the oracle is called in slices below it.
ORACLE_CHUNK_BYTES = 1 << 30


@dataclass(frozen=True)
class Geometry:
    """The shape of one forward, independent of the block size."""

    chunk_size: int
    frames: int
    sink_chunks: int
    window_chunks: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    batch: int = 1

    @property
    def q_tokens(self) -> int:
        """Query tokens per sequence."""
        return self.frames * self.chunk_size

    @property
    def kv_tokens(self) -> int:
        """Key tokens per sequence: the sink and the recent window."""
        return (self.sink_chunks + self.window_chunks) * self.chunk_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def attention_flops(self) -> int:
        """``4 * q * k * heads * head_dim`` over the batch (two matmuls, multiply-add = 2)."""
        return 4 * self.batch * self.q_tokens * self.kv_tokens * self.heads * self.head_dim


@dataclass(frozen=True)
class QuantizedPools:
    """The workload's pools as codes: ``k_cache``/``v_cache`` like the bf16 ones, and a float32
    scale per (block, slot, KV head)."""

    k_cache: Tensor
    v_cache: Tensor
    k_scale: Tensor
    v_scale: Tensor


@dataclass(frozen=True)
class EightBitPools:
    """The workload's pools in a one-switch format (``k8v8``, ``k8v16``), slot-major: int8 K
    codes with a float32 scale per (block, slot, KV head); V as e4m3 codes with frozen
    ``v_channel_scale (num_blocks, num_kv_heads, head_dim)`` (k8v8) or as stored (k8v16, None)."""

    k_cache: Tensor
    v_cache: Tensor
    k_scale: Tensor
    v_channel_scale: Tensor | None


@dataclass
class Workload:
    """Tensors for one (geometry, block size) case, on one device.

    ``keys``/``values`` are the logical K/V ``(batch, kv_tokens, kv_heads, head_dim)`` that the
    pool pages; ``new_keys``/``new_values`` are a fresh chunk that ``write_slots`` writes to
    ``write_slot_mapping``, the slots of each sequence's last ``q_tokens`` positions.
    """

    geometry: Geometry
    block_size: int
    q: Tensor
    k_cache: Tensor
    v_cache: Tensor
    block_table: Tensor
    cu_seqlens_q: Tensor
    seq_lens_k: Tensor
    keys: Tensor
    values: Tensor
    new_keys: Tensor
    new_values: Tensor
    write_slot_mapping: Tensor
    # The pools quantized, per codes dtype (``bench.providers.quantized_pools`` fills it) or
    # one-switch format name (``bench.providers.eight_bit_pools``).
    quantized: dict[torch.dtype | str, QuantizedPools | EightBitPools] = field(
        default_factory=dict, repr=False
    )

    @property
    def blocks_per_sequence(self) -> int:
        return self.block_table.shape[1]

    def attention_args(self) -> tuple[Tensor, ...]:
        """The positional arguments of ``paged_attention`` (kernel or oracle) for this case."""
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_table,
            self.cu_seqlens_q,
            self.seq_lens_k,
        )

    @property
    def block_ids(self) -> Tensor:
        """Every sequence's blocks, row after row (int32), as ``gather_blocks`` takes them."""
        return self.block_table.reshape(-1)

    @property
    def staged_tokens(self) -> int:
        """Rows of one sequence's staging buffer: whole blocks."""
        return self.blocks_per_sequence * self.block_size


def make_workload(
    geometry: Geometry,
    block_size: int,
    *,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_fraction: float = 0.25,
) -> Workload:
    """A paged pool with randomly permuted blocks holding the logical K/V of ``geometry``.

    The pool has a null block 0 and ``spare_fraction`` more blocks than the sequences use, all
    filled with random data so a kernel reading the wrong block gets a wrong answer.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    g = geometry
    dtype = g.torch_dtype
    data_gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=data_gen, device=device, dtype=torch.float32).to(dtype)

    q = randn(g.batch * g.q_tokens, g.heads, g.head_dim)
    keys = randn(g.batch, g.kv_tokens, g.kv_heads, g.head_dim)
    values = randn(g.batch, g.kv_tokens, g.kv_heads, g.head_dim)
    new_keys = randn(g.batch * g.q_tokens, g.kv_heads, g.head_dim)
    new_values = randn(g.batch * g.q_tokens, g.kv_heads, g.head_dim)

    blocks_per_sequence = math.ceil(g.kv_tokens / block_size)
    used = g.batch * blocks_per_sequence
    num_blocks = 1 + used + math.ceil(used * spare_fraction)
    layout_gen = torch.Generator().manual_seed(seed * 1_000_003 + block_size)
    owned = torch.randperm(num_blocks - 1, generator=layout_gen)[:used] + 1
    block_table = owned.view(g.batch, blocks_per_sequence).to(device=device, dtype=torch.int32)

    slot_shape = (num_blocks, block_size, g.kv_heads, g.head_dim)
    k_cache = randn(*slot_shape)
    v_cache = randn(*slot_shape)
    padded = blocks_per_sequence * block_size
    rows = block_table.reshape(-1).long()
    for cache, logical in ((k_cache, keys), (v_cache, values)):
        paged = cache[rows].view(g.batch, padded, g.kv_heads, g.head_dim)
        paged[:, : g.kv_tokens] = logical  # the tail of the last block keeps its random data
        cache[rows] = paged.view(used, block_size, g.kv_heads, g.head_dim)

    positions = torch.arange(g.kv_tokens - g.q_tokens, g.kv_tokens, device=device)
    write_blocks = block_table.long()[:, positions // block_size]
    write_slot_mapping = (write_blocks * block_size + positions % block_size).reshape(-1)

    q_lens = torch.full((g.batch,), g.q_tokens, dtype=torch.int32, device=device)
    cu_seqlens_q = torch.zeros(g.batch + 1, dtype=torch.int32, device=device)
    cu_seqlens_q[1:] = torch.cumsum(q_lens, 0)
    seq_lens_k = torch.full((g.batch,), g.kv_tokens, dtype=torch.int32, device=device)
    return Workload(
        geometry=g,
        block_size=block_size,
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens_k=seq_lens_k,
        keys=keys,
        values=values,
        new_keys=new_keys,
        new_values=new_values,
        write_slot_mapping=write_slot_mapping,
    )


def dequantized_sequences(workload: Workload, pools: QuantizedPools) -> tuple[Tensor, Tensor]:
    """Float64 logical K/V ``(batch, kv_tokens, kv_heads, head_dim)`` read back from quantized
    pools through the block table: what the dequantizing oracle attends over."""
    g = workload.geometry
    sequences = []
    for codes, scale in ((pools.k_cache, pools.k_scale), (pools.v_cache, pools.v_scale)):
        rows = [
            reference.quantize.dequantize(
                gather_sequence(codes, workload.block_table[seq], g.kv_tokens),
                gather_sequence(scale, workload.block_table[seq], g.kv_tokens),
            )
            for seq in range(g.batch)
        ]
        sequences.append(torch.stack(rows))
    return sequences[0], sequences[1]


def oracle_attention(
    workload: Workload,
    *,
    q: Tensor | None = None,
    keys: Tensor | None = None,
    values: Tensor | None = None,
) -> Tensor:
    """Float64 ``(total_q, heads, head_dim)`` from ``reference.dense_attention`` on the logical K/V
    (or on ``q``/``keys``/``values`` given in their place, e.g. dequantized ones).

    Called per sequence, per KV head (with its query heads) and per slice of queries, so the
    float64 scores stay under ``ORACLE_CHUNK_BYTES`` even at the shipped geometry.
    """
    q = workload.q if q is None else q
    keys = workload.keys if keys is None else keys
    values = workload.values if values is None else values
    g = workload.geometry
    group = g.heads // g.kv_heads
    rows_per_call = max(1, ORACLE_CHUNK_BYTES // (8 * group * g.kv_tokens))
    result = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for seq in range(g.batch):
        q_seq = q[seq * g.q_tokens : (seq + 1) * g.q_tokens]
        out_seq = result[seq * g.q_tokens : (seq + 1) * g.q_tokens]
        for kv_head in range(g.kv_heads):
            heads = slice(kv_head * group, (kv_head + 1) * group)
            head_keys = keys[seq, :, kv_head : kv_head + 1]
            head_values = values[seq, :, kv_head : kv_head + 1]
            for start in range(0, g.q_tokens, rows_per_call):
                rows = slice(start, start + rows_per_call)
                out_seq[rows, heads] = reference.dense_attention(
                    q_seq[rows, heads], head_keys, head_values
                )
    return result


def oracle_pools(workload: Workload) -> tuple[Tensor, Tensor]:
    """Flat K/V pools ``(num_slots, kv_heads, head_dim)`` after writing the new chunk."""
    g = workload.geometry
    k_pool = workload.k_cache.reshape(-1, g.kv_heads, g.head_dim).clone()
    v_pool = workload.v_cache.reshape(-1, g.kv_heads, g.head_dim).clone()
    for token, slot in enumerate(workload.write_slot_mapping.tolist()):
        k_pool[slot] = workload.new_keys[token]
        v_pool[slot] = workload.new_values[token]
    return k_pool, v_pool


def oracle_stage(workload: Workload) -> tuple[Tensor, Tensor]:
    """Staging buffers ``(batch * staged_tokens, kv_heads, head_dim)``: every visible block."""
    staged = [
        torch.cat(
            [
                gather_sequence(cache, workload.block_table[seq], workload.staged_tokens)
                for seq in range(workload.geometry.batch)
            ]
        )
        for cache in (workload.k_cache, workload.v_cache)
    ]
    return staged[0], staged[1]
