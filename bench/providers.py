"""Who computes each benchmarked kernel: this project's Triton kernels and the baselines.

Building a provider does all its set-up (layout changes, pre-gathering, staging buffers, block
masks) and returns a ``Bench`` whose ``run`` closure is the timed region alone. ``run`` returns
the kernel's result; ``to_reference_layout`` turns it into the oracle's layout, untimed.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

import kernels
import reference
from bench.workload import Geometry, Workload

# Largest float64 score tensor the timed oracle provider may build (it is timed whole).
ORACLE_TIMING_BYTES = 1 << 28

Output = Tensor | tuple[Tensor, ...]


@dataclass(frozen=True)
class Tile:
    """A ``block_m x block_n`` tile override for the Triton attention kernel."""

    block_m: int
    block_n: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}"


def _unchanged(output: Output) -> Output:
    return output


def _always_supported(workload: Workload) -> str | None:
    return None


@dataclass
class Bench:
    """A ready-to-time closure and how to compare what it returns."""

    run: Callable[[], Output]
    to_reference_layout: Callable[[Output], Output] = _unchanged


@dataclass(frozen=True)
class Provider:
    """One way of computing ``kernel``.

    ``unsupported`` returns why a workload cannot run (or None). A ``baseline`` that fails to
    build or run is reported and skipped; this project's kernels raise. ``tunable`` providers
    take the sweep's tile overrides.
    """

    kernel: str
    name: str
    build: Callable[[Workload, Tile | None], Bench]
    unsupported: Callable[[Workload], str | None] = _always_supported
    baseline: bool = False
    tunable: bool = False


def _tile_arguments(tile: Tile | None) -> dict[str, int]:
    return {} if tile is None else {"block_m": tile.block_m, "block_n": tile.block_n}


def _heads_first_queries(workload: Workload) -> Tensor:
    g = workload.geometry
    return workload.q.view(g.batch, g.q_tokens, g.heads, g.head_dim).transpose(1, 2).contiguous()


def _packed_from_heads_first(geometry: Geometry) -> Callable[[Output], Output]:
    g = geometry
    return lambda out: out.transpose(1, 2).reshape(g.batch * g.q_tokens, g.heads, g.head_dim)


def _sequence_view(stage: Tensor, workload: Workload) -> Tensor:
    """``(batch, kv_heads, kv_tokens, head_dim)`` view of rows staged block after block."""
    g = workload.geometry
    rows = stage.view(g.batch, workload.staged_tokens, g.kv_heads, g.head_dim)
    return rows[:, : g.kv_tokens].transpose(1, 2)


def _sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """SDPA with torch's own backend choice (the best one available for these inputs)."""
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])


def _stage_buffers(workload: Workload) -> tuple[Tensor, Tensor]:
    """NaN-filled staging buffers, so a row the gather misses cannot pass the check."""
    g = workload.geometry
    shape = (g.batch * workload.staged_tokens, g.kv_heads, g.head_dim)
    fill = dict(dtype=workload.k_cache.dtype, device=workload.k_cache.device)
    return torch.full(shape, math.nan, **fill), torch.full(shape, math.nan, **fill)


# --- paged_attention -----------------------------------------------------------------------


def _build_triton_paged(workload: Workload, tile: Tile | None) -> Bench:
    w = workload
    out = torch.empty_like(w.q)
    tiles = _tile_arguments(tile)

    def run() -> Tensor:
        return kernels.paged_attention(
            *w.attention_args(),
            max_seqlen_q=w.geometry.q_tokens,
            out=out,
            check_values=False,
            **tiles,
        )

    return Bench(run)


def _build_reference_paged(workload: Workload, tile: Tile | None) -> Bench:
    w = workload
    return Bench(
        lambda: reference.paged_attention(*w.attention_args(), max_seqlen_q=w.geometry.q_tokens)
    )


def _reference_unsupported(workload: Workload) -> str | None:
    g = workload.geometry
    scores = 8 * g.batch * g.heads * g.q_tokens * g.kv_tokens
    if scores > ORACLE_TIMING_BYTES:
        return f"the float64 oracle would hold {scores / 2**30:.1f} GiB of scores; timed small only"
    return None


def _build_sdpa_pregathered(workload: Workload, tile: Tile | None) -> Bench:
    q = _heads_first_queries(workload)
    rows = workload.block_ids.long()
    k = _sequence_view(workload.k_cache[rows], workload).contiguous()
    v = _sequence_view(workload.v_cache[rows], workload).contiguous()
    return Bench(lambda: _sdpa(q, k, v), _packed_from_heads_first(workload.geometry))


def _build_sdpa_with_gather(workload: Workload, tile: Tile | None) -> Bench:
    w = workload
    q = _heads_first_queries(w)
    rows = w.block_ids.long()

    def run() -> Tensor:
        k = _sequence_view(w.k_cache[rows], w)
        v = _sequence_view(w.v_cache[rows], w)
        return _sdpa(q, k, v)

    return Bench(run, _packed_from_heads_first(w.geometry))


def flex_key_tile(block_size: int) -> int | None:
    """FlexAttention's key tile for a paged block mask of ``block_size`` (None: impossible).

    The block mask's key block is one cache block, and it must be a multiple of the kernel's
    key tile, a power of two of at least 16.
    """
    largest_power_of_two = block_size & -block_size
    return None if largest_power_of_two < 16 else min(64, largest_power_of_two)


def flex_paged_inputs(workload: Workload) -> tuple[Tensor, Tensor, Tensor, object]:
    """Queries, the whole pool as one key sequence, and a block mask that pages it.

    Key index ``j`` of the flex call is pool slot ``j``; the mask admits the slots holding the
    sequence's keys, and its key blocks are the cache blocks, so blocks outside the table are
    skipped whole.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    w = workload
    g = w.geometry
    device = w.q.device
    num_slots = w.k_cache.shape[0] * w.block_size
    positions = torch.arange(g.kv_tokens, device=device)
    slots = w.block_table.long()[:, positions // w.block_size] * w.block_size
    slots += positions % w.block_size
    slot_position = torch.full((g.batch, num_slots), -1, dtype=torch.int32, device=device)
    slot_position.scatter_(1, slots, positions.int().expand(g.batch, -1).contiguous())

    def holds_a_key(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return slot_position[b, kv_idx] >= 0

    block_mask = create_block_mask(
        holds_a_key,
        g.batch,
        None,
        g.q_tokens,
        num_slots,
        device=device,
        BLOCK_SIZE=(128, w.block_size),
    )

    def pool_as_sequence(cache: Tensor) -> Tensor:
        flat = cache.view(num_slots, g.kv_heads, g.head_dim).permute(1, 0, 2)
        return flat.unsqueeze(0).expand(g.batch, -1, -1, -1)

    q = _heads_first_queries(w)
    return q, pool_as_sequence(w.k_cache), pool_as_sequence(w.v_cache), block_mask


@functools.cache
def _compiled_flex_attention() -> Callable[..., Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _build_flex(workload: Workload, tile: Tile | None) -> Bench:
    q, k, v, block_mask = flex_paged_inputs(workload)
    flex_attention = _compiled_flex_attention()
    options = {"BLOCK_N": flex_key_tile(workload.block_size)}
    gqa = workload.geometry.heads != workload.geometry.kv_heads
    return Bench(
        lambda: flex_attention(
            q, k, v, block_mask=block_mask, enable_gqa=gqa, kernel_options=options
        ),
        _packed_from_heads_first(workload.geometry),
    )


def _flex_unsupported(workload: Workload) -> str | None:
    if workload.q.device.type != "cuda":
        return "compiled FlexAttention is timed on a GPU only (a CPU compile takes tens of seconds)"
    if flex_key_tile(workload.block_size) is None:
        return f"block_size {workload.block_size} is not a multiple of FlexAttention's 16-key tile"
    return None


def _build_flash_attn(workload: Workload, tile: Tile | None) -> Bench:
    from flash_attn import flash_attn_with_kvcache

    w = workload
    g = w.geometry
    q = w.q.view(g.batch, g.q_tokens, g.heads, g.head_dim)
    return Bench(
        lambda: flash_attn_with_kvcache(
            q, w.k_cache, w.v_cache, cache_seqlens=w.seq_lens_k, block_table=w.block_table
        ),
        lambda out: out.reshape(g.batch * g.q_tokens, g.heads, g.head_dim),
    )


def _flash_attn_unsupported(workload: Workload) -> str | None:
    if importlib.util.find_spec("flash_attn") is None:
        return "flash_attn is not installed"
    if workload.q.device.type != "cuda":
        return "flash_attn needs a GPU"
    if workload.geometry.dtype not in ("fp16", "bf16"):
        return "flash_attn takes fp16 and bf16 only"
    if workload.block_size % 256:
        return f"flash_attn's paged cache needs block_size % 256 == 0, got {workload.block_size}"
    return None


# --- staged: gather the visible blocks, then attend over contiguous K/V -----------------------


# Each sequence's staging region is padded to a multiple of this, so the stage can be handed to
# the attention kernel as blocks of this size and take its contiguous-tile path.
STAGE_ALIGN = 256


def _padded_stage(workload: Workload) -> tuple[Callable[[], None], Tensor, Tensor]:
    """Per-sequence staging regions of whole ``STAGE_ALIGN`` blocks (NaN in the padding).

    Returns the gather (one ``gather_blocks`` per sequence) and the K/V regions as
    ``(batch, padded_tokens, kv_heads, head_dim)``.
    """
    w = workload
    g = w.geometry
    padded = math.ceil(w.staged_tokens / STAGE_ALIGN) * STAGE_ALIGN
    shape = (g.batch, padded, g.kv_heads, g.head_dim)
    fill = dict(dtype=w.k_cache.dtype, device=w.k_cache.device)
    k_rows, v_rows = torch.full(shape, math.nan, **fill), torch.full(shape, math.nan, **fill)
    regions = [(w.block_table[seq], k_rows[seq], v_rows[seq]) for seq in range(g.batch)]

    def gather() -> None:
        for block_ids, stage_k, stage_v in regions:
            kernels.gather_blocks(
                w.k_cache, w.v_cache, block_ids, stage_k, stage_v, check_values=False
            )

    return gather, k_rows, v_rows


def _build_staged_triton(workload: Workload, tile: Tile | None) -> Bench:
    w = workload
    g = w.geometry
    gather, k_rows, v_rows = _padded_stage(w)
    blocks = (-1, STAGE_ALIGN, g.kv_heads, g.head_dim)
    k_blocks, v_blocks = k_rows.view(blocks), v_rows.view(blocks)
    device = w.q.device
    stage_table = torch.arange(k_blocks.shape[0], dtype=torch.int32, device=device)
    stage_table = stage_table.view(g.batch, -1)
    out = torch.empty_like(w.q)
    tiles = _tile_arguments(tile)

    def run() -> Tensor:
        gather()
        return kernels.paged_attention(
            w.q,
            k_blocks,
            v_blocks,
            stage_table,
            w.cu_seqlens_q,
            w.seq_lens_k,
            max_seqlen_q=g.q_tokens,
            out=out,
            check_values=False,
            **tiles,
        )

    return Bench(run)


def _build_staged_sdpa(workload: Workload, tile: Tile | None) -> Bench:
    w = workload
    kv_tokens = w.geometry.kv_tokens
    gather, k_rows, v_rows = _padded_stage(w)
    q = _heads_first_queries(w)
    k, v = k_rows[:, :kv_tokens].transpose(1, 2), v_rows[:, :kv_tokens].transpose(1, 2)

    def run() -> Tensor:
        gather()
        return _sdpa(q, k, v)

    return Bench(run, _packed_from_heads_first(w.geometry))


# --- gather_blocks ---------------------------------------------------------------------------


def _build_gather_triton(workload: Workload, tile: Tile | None) -> Bench:
    w = workload
    stage_k, stage_v = _stage_buffers(w)

    def run() -> tuple[Tensor, Tensor]:
        kernels.gather_blocks(
            w.k_cache, w.v_cache, w.block_ids, stage_k, stage_v, check_values=False
        )
        return stage_k, stage_v

    return Bench(run)


def _build_gather_torch(workload: Workload, tile: Tile | None) -> Bench:
    w = workload
    stage_k, stage_v = _stage_buffers(w)
    block_shape = (-1, *w.k_cache.shape[1:])
    k_blocks, v_blocks = stage_k.view(block_shape), stage_v.view(block_shape)
    rows = w.block_ids.long()

    def run() -> tuple[Tensor, Tensor]:
        torch.index_select(w.k_cache, 0, rows, out=k_blocks)
        torch.index_select(w.v_cache, 0, rows, out=v_blocks)
        return stage_k, stage_v

    return Bench(run)


# --- write_slots -----------------------------------------------------------------------------


def _fresh_pools(workload: Workload) -> tuple[Tensor, Tensor]:
    g = workload.geometry
    flat = (-1, g.kv_heads, g.head_dim)
    return workload.k_cache.reshape(flat).clone(), workload.v_cache.reshape(flat).clone()


def _build_write_triton(workload: Workload, tile: Tile | None) -> Bench:
    w = workload
    k_pool, v_pool = _fresh_pools(w)

    def run() -> tuple[Tensor, Tensor]:
        kernels.write_slots(
            w.new_keys, w.new_values, k_pool, v_pool, w.write_slot_mapping, check_values=False
        )
        return k_pool, v_pool

    return Bench(run)


def _build_write_torch(workload: Workload, tile: Tile | None) -> Bench:
    w = workload
    k_pool, v_pool = _fresh_pools(w)

    def run() -> tuple[Tensor, Tensor]:
        k_pool.index_copy_(0, w.write_slot_mapping, w.new_keys)
        v_pool.index_copy_(0, w.write_slot_mapping, w.new_values)
        return k_pool, v_pool

    return Bench(run)


PROVIDERS: tuple[Provider, ...] = (
    Provider("paged_attention", "triton", _build_triton_paged, tunable=True),
    Provider("paged_attention", "reference", _build_reference_paged, _reference_unsupported),
    Provider("paged_attention", "sdpa", _build_sdpa_pregathered, baseline=True),
    Provider("paged_attention", "sdpa+gather", _build_sdpa_with_gather, baseline=True),
    Provider("paged_attention", "flex", _build_flex, _flex_unsupported, baseline=True),
    Provider("paged_attention", "flash_attn", _build_flash_attn, _flash_attn_unsupported, True),
    Provider("staged", "triton", _build_staged_triton, tunable=True),
    Provider("staged", "triton+sdpa", _build_staged_sdpa, baseline=True),
    Provider("gather_blocks", "triton", _build_gather_triton),
    Provider("gather_blocks", "torch", _build_gather_torch, baseline=True),
    Provider("write_slots", "triton", _build_write_triton),
    Provider("write_slots", "torch", _build_write_torch, baseline=True),
)
PROVIDER_NAMES = tuple(dict.fromkeys(p.name for p in PROVIDERS))
