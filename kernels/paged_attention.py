"""Varlen, non-causal (optionally causal) attention of packed queries over a paged K/V cache:
the launcher (tile choice, launch table, dispatch). The kernel is in ``kernels/_attention_jit.py``,
the argument checks in ``kernels/_attention_checks.py``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_video._removed import refuse_removed
from paged_video.kernels import (
    _checks,
    launch_table,
    pool_layout,
    query_codes,
    torch_path,
    value_channels,
    value_units,
)
from paged_video.kernels._attention_checks import check_arguments
from paged_video.kernels._attention_jit import _paged_attention_kernel
from paged_video.kernels._attention_ws_jit import _paged_attention_ws_kernel
from paged_video.kernels._runtime import interpreter_active, use_torch_path
from paged_video.kernels.merge_states import merge_attention_states

LOG2E = 1.4426950408889634


def _is_tile(value: int) -> bool:
    return value >= 16 and value & (value - 1) == 0


# GPU launch settings per (head_dim up to, 16-bit or fp32): BLOCK_M, BLOCK_N, warps, stages.
# Checked for registers, spills and pipelining by `python -m paged_video.bench compile`. At
# head_dim 256, 16-bit: 128 x 64 at 2 stages (196.6 KB of shared memory) compiles without
# spills at 255 registers, and its loop does a quarter of the instructions per query row and
# key of the 64 x 32 one it replaced (whose 8 warps split 32 keys into MMAs of 16 columns).
_GPU_TILES: dict[tuple[int, bool], tuple[int, int, int, int]] = {
    (64, True): (128, 64, 8, 3),
    (128, True): (128, 64, 8, 3),
    (256, True): (128, 64, 8, 2),
    (64, False): (64, 32, 4, 2),
    (128, False): (64, 32, 4, 2),
    (256, False): (64, 32, 4, 2),
}
# Quantized caches at head_dim 256 keep 64 x 32 tiles: their loops hold the converted tiles
# and the scales beside what the 16-bit loop holds (without spills there, bench/COMPILE.md).
_QUANTIZED_WIDE_TILES = (64, 32, 8, 2)


def _largest_offset(pool: Tensor) -> int:
    """The largest element offset into a pool from its first element (strides are >= 0)."""
    return sum((size - 1) * stride for size, stride in zip(pool.shape, pool.stride(), strict=True))


def _descriptor_layout(
    k_cache: Tensor,
    v_cache: Tensor,
    block_d: int,
    head_dim: int,
    scales: tuple[Tensor, ...] | None = None,
    v_8bit: bool = False,
) -> bool:
    """True when each pool reads as the tensor the TMA loop's descriptors describe, within TMA's
    limits: codes as (block, slot) rows of (KV head, channel) columns; quantized ``scales`` (K's
    and V's) keys-major and aligned (``kernels.keys_major``), each a run of (block, KV head,
    slot) scales (slot-major, a tile's scales of one head are 4 bytes apart: too narrow for a
    descriptor's rows); with ``v_8bit`` (k8v8's e4m3 V) V keys-major too, read
    as (block, KV head, channel) rows of slots (its P V MMA reads V keys-contiguous, a
    transpose no descriptor gives)."""
    if block_d != head_dim:
        return False  # a tile's columns would run into the next head's
    pools = (k_cache,) if v_8bit else (k_cache, v_cache)
    for pool in pools:
        blocks, block_size, heads, _ = pool.shape
        stride_block, stride_slot, stride_head, stride_dim = pool.stride()
        size = pool.element_size()
        if stride_dim != 1 or stride_head != head_dim or stride_slot != heads * head_dim:
            return False
        if stride_block != block_size * stride_slot or blocks * block_size >= 2**31:
            return False
        if pool.data_ptr() % 16 or stride_slot * size % 16:
            return False
    if scales is not None and not all(map(_keys_major_rows, scales)):
        return False
    return not v_8bit or _keys_major_rows(v_cache)


def _keys_major_rows(pool: Tensor) -> bool:
    """True when ``pool`` (codes or scales) is keys-major and aligned, its blocks' rows of keys
    following each other in (block, KV head[, channel]) order, fewer than 2**31 elements in
    all."""
    if not pool_layout.keys_aligned(pool):
        return False
    blocks, _, heads = pool.shape[:3]
    stride_block, _, stride_head = pool.stride()[:3]
    if pool.dim() == 4 and stride_head != pool.shape[3] * pool.stride(3):
        return False
    return stride_block == heads * stride_head and blocks * stride_block < 2**31


def _warp_specialized_refusal(
    q: Tensor, group: int, causal: bool, key_limits: Tensor | None, key_gap: Tensor | None
) -> str | None:
    """Why the warp-specialized kernel cannot take a call (None: it can)."""
    if causal or key_limits is not None or key_gap is not None:
        return "attends whole tiles unmasked: no causal, key_limits or key_gap"
    if group != 1:
        return "takes one query head per KV head"
    if q.dtype == torch.float32 and not interpreter_active():
        return "takes fp16/bf16 queries on a GPU (float32 MMAs do not specialize)"
    size = q.element_size()
    if q.stride(2) != 1 or q.stride(1) != q.shape[2] or q.stride(0) * size % 16:
        return "needs q's heads and channels packed, rows 16-byte aligned"
    if q.data_ptr() % 16 or q.shape[0] >= 2**31:
        return "needs q 16-byte aligned, fewer than 2**31 tokens"
    return None


def _warp_specialized(
    args: tuple[Tensor, ...],
    *,
    max_seqlen_q: int,
    scale: float,
    tiles: dict,
    out: Tensor,
    lse: Tensor | None,
) -> Tensor | tuple[Tensor, Tensor]:
    """The ``ws`` variant: the whole key tiles in the warp-specialized kernel, the partial last
    tile of each sequence in the masked kernel (a key gap hides the whole tiles from it), merged
    by their log-sum-exps. ``scale`` >= 0."""
    q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k = args
    block_n, block_size = tiles["BLOCK_N"], k_cache.shape[1]
    whole_out = torch.empty_like(q)
    whole_lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    if not interpreter_active():
        _ensure_allocator()
    grid = (triton.cdiv(max_seqlen_q, tiles["BLOCK_M"]), block_table.shape[0], k_cache.shape[2])
    _paged_attention_ws_kernel[grid](
        q,
        k_cache,
        v_cache,
        whole_out,
        whole_lse,
        block_table,
        cu_seqlens_q,
        seq_lens_k,
        scale * LOG2E,
        k_cache.shape[0] * block_size,
        q.stride(0),
        k_cache.stride(1),
        v_cache.stride(1),
        *whole_out.stride()[:2],
        *block_table.stride(),
        *whole_lse.stride(),
        BLOCK_M=tiles["BLOCK_M"],
        BLOCK_N=block_n,
        HEAD_DIM=q.shape[2],
        BLOCK_SIZE=block_size,
        # Triton specializes 4-warp consumers (at 8 warps it builds a plain loop).
        num_warps=4,
        num_stages=min(tiles["num_stages"], WS_MAX_STAGES),
    )
    whole = (seq_lens_k // block_n * block_n).to(torch.int32)
    key_gap = torch.stack([torch.zeros_like(whole), whole], dim=-1)
    tail_out, tail_lse = paged_attention(
        *args,
        max_seqlen_q=max_seqlen_q,
        softmax_scale=scale,
        key_gap=key_gap,
        block_m=tiles["BLOCK_M"],
        block_n=block_n,
        variant="cp_async",
        check_values=False,
        return_lse=True,
    )
    out, out_lse = merge_attention_states(
        whole_out, whole_lse, tail_out, tail_lse, out=out, out_lse=lse
    )
    return (out, out_lse) if lse is not None else out


def _ensure_allocator() -> None:
    """Give Triton a scratch allocator for device-made descriptors, unless one is set."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(
            lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda")
        )


def table_key(block_size: int, head_dim: int) -> tuple[int, str]:
    """A 16-bit call's row of the launch table: its head_dim class and its key path at the
    built-in key tile of that class."""
    dim_class = launch_table.head_dim_class(head_dim)
    return dim_class, kv_path(block_size, _GPU_TILES[(dim_class, True)][1])


def table_block_m(head_dim: int) -> int:
    """The query tile of every launch-table row of ``head_dim``'s class (rows name no BLOCK_M;
    a short call takes a smaller one)."""
    return _GPU_TILES[(launch_table.head_dim_class(head_dim), True)][0]


def _block_d(head_dim: int, eight_bit_mma: bool) -> int:
    """The tile's channels: ``head_dim`` rounded up to a power of two, at least 16 (32 for the
    8-bit MMAs, which reduce over 32 channels at least)."""
    return max(32 if eight_bit_mma else 16, triton.next_power_of_2(head_dim))


def _descriptor_tiles(
    block_size: int, block_n: int, quantized: bool, block_pairs: bool = False
) -> bool:
    """True when the unmasked loop's tiles are what descriptors load: tiles inside one block
    (the contiguous path, and the whole tiles of ``block_tiles`` blocks larger than the tile),
    or, with ``block_pairs`` and 16-bit pools, tiles of two whole blocks (the rows path at
    ``block_n == 2 * block_size``: a descriptor load per block, ``_attend_block_pairs``).
    ``quantized``: every unmasked loop's tiles (a block cut into more pieces runs their
    unmasked loops by pointer, and the quantized pointer loops spill at 128 keys)."""
    if kv_path(block_size, block_n) == "rows":
        return block_pairs and not quantized and two_block_tiles(block_size, block_n)
    # A piece's tiles lie inside one block when the tile divides it (the first piece: the whole
    # block on the contiguous path, its whole tiles on block_tiles; never on two_blocks).
    inside = [only or size % block_n == 0 for _, size, only in block_pieces(block_size, block_n)]
    return all(inside) if quantized else inside[0]


def two_block_tiles(block_size: int, block_n: int) -> bool:
    """True when each key tile is two whole blocks (a ``rows`` path tile at ``block_n == 2 *
    block_size``): the 16-bit TMA loop reads them a block per descriptor load where the caller
    names ``variant="tma"`` (``_attend_block_pairs``); a table row reads them by pointer."""
    return block_n == 2 * block_size


def kv_path(block_size: int, block_n: int) -> str:
    """How a key tile of ``block_n`` rows finds its cache rows in blocks of ``block_size``
    (docs/kernels.md, "How any block size stays fast")."""
    if block_size % block_n == 0:
        return "contiguous"
    if len(block_pieces(block_size, block_n)) > 1:
        return "block_tiles"
    return "two_blocks" if block_size >= block_n else "rows"


# The most pieces ``block_tiles`` cuts a block into: its whole tiles and the 7 powers of two
# below 128, so at tiles up to 128 keys every block size takes it (or the contiguous path, or
# the rows path of a block dividing the tile); only tiles of 256 keys or more leave blocks to
# the straddling paths, whose hot loops were 1.12-1.30x the plain loop (block 31, 94, 190 at
# head_dim 128) against 1.08-1.11x cut in pieces. Each piece compiles an unmasked and a masked
# loop of its own (about 3.7 s more per piece for an sm_90a build on 2 CPU cores, and about
# 20 KB of code) and reads its table entries again at each run's edges.
MAX_PIECES = 8


def block_pieces(block_size: int, block_n: int) -> tuple[tuple[int, int, bool], ...]:
    """The pieces ``(offset, size, masked only)`` that ``block_tiles`` cuts each block into, in
    block order, so that the keys of each piece fill tiles without straddling one; the whole
    block alone where the path does not apply. A block larger than the tile is cut after its
    whole tiles when the rest is at most a quarter of the block (1560 = 1536 + 24 at 64-key
    tiles), the rest masked only. Otherwise a block that is not a multiple of the tile is cut
    into its whole tiles (if any) and the powers of two of the rest, up to ``MAX_PIECES`` pieces
    (24 = 16 + 8, 7 = 4 + 2 + 1, 100 = 64 + 32 + 4 at 64-key tiles): each power divides the
    tile, so a tile holds whole pieces and reads one table entry per piece."""
    rest = block_size % block_n
    whole = block_size - rest
    if rest == 0:
        return ((0, block_size, False),)
    if whole and 4 * rest <= block_size:
        return ((0, whole, False), (whole, rest, True))
    sizes = [1 << bit for bit in reversed(range(rest.bit_length())) if rest >> bit & 1]
    if whole:
        sizes.insert(0, whole)
    if len(sizes) > MAX_PIECES:
        return ((0, block_size, False),)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return tuple((offset, size, False) for offset, size in zip(offsets, sizes, strict=True))


# The warp-specialized kernel's most stages: on an H200 with Triton 3.6 (2026-12-04), this
# kernel and the Triton tutorial's warp-specialized loop both wrote NaN at 3 stages and were
# right at 2 (bench/RESULTS.md).
WS_MAX_STAGES = 2


def _table_row(
    *,
    block_size: int,
    head_dim: int,
    mode: str,
    block_n: int | None,
    variant: str | None,
) -> dict | None:
    """The launch table's row for a call on a GPU, where it applies: as a whole, where the
    caller sets neither tile nor variant or sets them as the row does (a caller's other tile or
    variant keeps the built-in settings for the rest, whatever the table says). A quantized
    ``tma`` row applies only where its tile lies inside a block (its pointer loop at that tile
    is no measured launch: at 128 keys the quantized pointer loops spill 96-120 bytes,
    bench/COMPILE.md); a 16-bit one runs the pointer loop at its tile there, as the GPU run
    that chose it measured (tiles of two whole blocks too: ``_descriptor_tiles``)."""
    row = launch_table.lookup(*table_key(block_size, head_dim), mode)
    if row is None:
        return None
    if block_n not in (None, row["block_n"]) or variant not in (None, row["variant"]):
        return None
    if mode != "same" and row["variant"] == "tma":
        return row if _descriptor_tiles(block_size, row["block_n"], quantized=True) else None
    return row


def table_mode(
    *,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
    dequantize: bool = False,
    tma_ready: bool = False,
    k8v8: bool = False,
    k8v16: bool = False,
) -> str | None:
    """The launch table's K/V mode of a call (``choose_tiles``' arguments of the same names), or
    None where the table has no row for it: float32 queries, and dequantizing calls that do not
    name their codes' dtype."""
    quantized = dequantize or k8v8 or k8v16
    if dtype == torch.float32 or (dequantize and kv_dtype is None):
        return None
    return launch_table.kv_mode(
        kv_dtype if quantized else None,
        keys_major=quantized and tma_ready,
        k8v8=k8v8,
        k8v16=k8v16,
    )


def _check_scores_ahead(scores_ahead: object, quantized: bool, variant: str | None) -> None:
    """``scores_ahead`` is None or a bool, and True only for a loop that has it."""
    if scores_ahead is not None and not isinstance(scores_ahead, bool):
        raise TypeError(f"scores_ahead must be a bool or None, got {type(scores_ahead).__name__}")
    if scores_ahead and quantized:
        raise ValueError("scores_ahead runs over 16-bit caches only; leave it None for quantized")
    if scores_ahead and variant == "ws":
        raise ValueError("scores_ahead is a loop of the 'cp_async' and 'tma' variants, not 'ws'")


def choose_tiles(
    *,
    block_size: int,
    head_dim: int,
    max_seqlen_q: int,
    dtype: torch.dtype,
    block_m: int | None = None,
    block_n: int | None = None,
    heads_per_kv_head: int = 1,
    dequantize: bool = False,
    variant: str | None = None,
    scores_ahead: bool | None = None,
    tma_ready: bool = False,
    kv_dtype: torch.dtype | None = None,
    k8v8: bool = False,
    v_block_scales: bool = False,
    k8v16: bool = False,
) -> dict[str, int | str | bool]:
    """Tile sizes, key path and launch settings for one call, with the caller's overrides.

    A tile's M rows are (query, head) pairs of one KV head, so ``heads_per_kv_head`` times the
    queries. Under the interpreter every program is a batch of numpy ops, so big tiles are much
    faster. On a GPU the settings come from the launch table (``kernels/launch_choices.json``,
    per head_dim class, key path and K/V mode: ``_table_row``) and, where it has no row, from
    built-in settings per (head_dim, dtype).
    ``dequantize``: K/V codes (``kv_dtype``, which picks the table's row) converted to ``dtype``
    before the MMAs. Triton's pipeliner then keeps loads one stage closer to their use (they
    feed a conversion, not the MMA), so the built-in settings take one more stage, to keep as
    many K/V tiles in flight (checked by ``python -m paged_video.bench compile``).
    The quantized modes' built-in tiles are 64 keys, on Triton 3.9 as on 3.6: at hd 128,
    bf16, blocks 16..1560 they compile without spills in the key loops at 7.8-10.9 SASS
    instructions per key (docs/kernels.md); 3.6 once took 32-key tiles (13.4-20.3 per key),
    when its 64-key ones spilled 250-480 bytes; the pointer loop's 128-key tiles spill 96-120
    bytes. The 8-bit MMAs reduce over at least 32 channels, so their ``BLOCK_D`` is at least
    32. ``scores_ahead``: the unmasked loop computes each tile's scores one iteration ahead
    (16-bit caches, the pointer and TMA loops; default: the table row's choice, else off).
    ``tma_ready``: the pools are ones the TMA loop reads (``_descriptor_layout``), the
    table's ``_keys`` modes: by the shipped table's rows, the quantized modes over such pools
    at head_dim 128 take 128-key TMA tiles where a tile lies inside a block (int8 7.2-7.4
    instructions per key), unless the caller sets another tile or variant.
    ``k8v8``: the k8v8 format (int8 ``Q K^T``, FP8 ``P V``); with ``v_block_scales`` (V's
    scales per block) every key tile must lie inside one block: the key tile is the largest
    that divides the block (at least 32 keys, else a ``ValueError``). ``k8v16``: int8 ``Q K^T``,
    16-bit ``P V`` over V as stored.
    """
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value is not None and (not isinstance(value, int) or not _is_tile(value)):
            raise ValueError(f"{name} must be a power of two >= 16, got {value!r}")
    quantized = dequantize or k8v8 or k8v16
    if variant is not None and variant not in launch_table.VARIANTS:
        raise ValueError(
            f"variant must be one of {', '.join(launch_table.VARIANTS)}, got {variant!r}"
        )
    if variant == "ws" and quantized:
        raise ValueError("variant 'ws' loads unquantized caches only; use 'tma' or 'cp_async'")
    _check_scores_ahead(scores_ahead, quantized, variant)
    chosen, chosen_ahead = "cp_async", False
    rows = max(1, max_seqlen_q) * max(1, heads_per_kv_head)
    short_q = max(16, triton.next_power_of_2(rows))
    if interpreter_active():
        # 1024 x 512 scores stay under Triton's 2**20-element block limit.
        default_m, default_n, warps, stages = min(1024, short_q), 512, 4, 1
    else:
        dim_class = launch_table.head_dim_class(head_dim)
        default_m, default_n, warps, stages = _GPU_TILES[(dim_class, dtype != torch.float32)]
        if quantized and dim_class == 256:
            default_m, default_n, warps, stages = _QUANTIZED_WIDE_TILES
        stages += dequantize
        mode = table_mode(
            dtype=dtype, kv_dtype=kv_dtype, dequantize=dequantize, tma_ready=tma_ready,
            k8v8=k8v8, k8v16=k8v16,
        )  # fmt: skip
        row = None
        if mode is not None:
            row = _table_row(
                block_size=block_size, head_dim=head_dim, mode=mode, block_n=block_n,
                variant=variant,
            )  # fmt: skip
        if row is not None:
            default_n, chosen, chosen_ahead = row["block_n"], row["variant"], row["scores_ahead"]
            # The warp-specialized kernel runs its own warps and stages (_warp_specialized); a
            # call it falls back from (a path or a call it does not take) runs the TMA or
            # pointer loop, at the built-in ones, not at a 4-warp consumer's.
            if chosen != "ws":
                warps, stages = row["num_warps"], row["num_stages"]
        if short_q < default_m:
            default_m, warps = short_q, 4
    tile_m = block_m or default_m
    tile_n = block_n or default_n
    if k8v8 and tile_n < launch_table.FP8_MIN_KEYS:
        # The FP8 P V MMA reduces over the tile's keys; Hopper's FP8 wgmma takes 32 at least
        # (a 16-key tile fails to compile on a GPU, though the interpreter runs it).
        if block_n is not None:
            raise ValueError(
                f"block_n must be >= {launch_table.FP8_MIN_KEYS} with k8v8, got {block_n}"
            )
        tile_n = launch_table.FP8_MIN_KEYS
    if v_block_scales and block_size % tile_n:
        # A block's V scales multiply its tiles' P V sums: a tile must lie inside one block.
        fits = [n for n in (128, 64, 32) if n <= tile_n and block_size % n == 0]
        if block_n is not None or not fits:
            raise ValueError(
                f"V scales per block need key tiles inside one block (block_size a multiple "
                f"of the tile, >= {launch_table.FP8_MIN_KEYS}): block_size {block_size}, tile "
                f"{tile_n}; use a frozen v_channel_scale (block stride 0)"
            )
        tile_n = fits[0]
    path = kv_path(block_size, tile_n)
    # Descriptor loads are for tiles inside one block (block_tiles: the whole-tile piece, when
    # its keys fill tiles) and, when the caller asks for "tma", 16-bit tiles of two whole
    # blocks (a table row applies as its GPU run measured it, and those ran the pointer loop
    # there); other paths keep the pointer loop. The warp-specialized kernel takes the
    # contiguous path's tiles only.
    ahead = chosen_ahead if scores_ahead is None else scores_ahead
    block_pairs = variant == "tma"
    variant = variant or chosen
    if variant == "ws" and (path in ("block_tiles", "rows") or ahead):
        # (Nor has it a loop with the scores ahead.) The TMA loop runs the other paths' tiles,
        # and calls with the scores ahead.
        variant = "tma"
    variant = (
        variant if _descriptor_tiles(block_size, tile_n, quantized, block_pairs) else "cp_async"
    )
    return {
        "BLOCK_M": tile_m,
        "BLOCK_N": tile_n,
        "BLOCK_D": _block_d(head_dim, k8v8 or k8v16),
        "KV_PATH": path,
        "PIECES": block_pieces(block_size, tile_n),
        "TMA": variant in ("tma", "ws"),
        "SCORES_AHEAD": ahead,
        "VARIANT": variant,
        "WIDE_SCALES": False,
        "SCORE_BITS": False,
        "num_warps": warps,
        "num_stages": stages,
    }


def _eight_bit_formats(
    k_scale: Tensor | None, v_scale: Tensor | None, v_channel_scale: Tensor | None
) -> tuple[bool, bool, bool]:
    """``(k8v8, k8v16, v_block_scales)`` of a call's scale tensors: k8v8 has V's channel
    scales (per block unless frozen), k8v16 int8 K's scales and no V scales (V as stored)."""
    k8v8 = v_channel_scale is not None
    k8v16 = k_scale is not None and v_scale is None and not k8v8
    return k8v8, k8v16, k8v8 and not value_channels.is_frozen(v_channel_scale)


def call_tiles(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    max_seqlen_q: int,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    v_channel_scale: Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    variant: str | None = None,
    scores_ahead: bool | None = None,
) -> dict[str, int | str | bool]:
    """The launch ``paged_attention`` takes on this machine for these tensors and settings (the
    keywords of the same names): ``choose_tiles``' result for the call, whose ``VARIANT`` is
    the loop asked for before the pools' layout is weighed, and ``TMA_READY``, whether the
    pools are ones the TMA loop reads (else a ``tma`` choice runs ``cp_async``). For a
    notebook asking which loop a call runs, and for oracles that model the kernel's tile
    (``bench accuracy``'s k8v8 emulation adds the FP8 MMA's sums into float32 once a tile, as
    the kernel does). The tensors are taken as ``paged_attention`` checks them: only their
    ranks are checked here."""
    for name, tensor, rank in (("q", q, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
        if tensor.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D, got shape {tuple(tensor.shape)}")
    k8v8, k8v16, v_block_scales = _eight_bit_formats(k_scale, v_scale, v_channel_scale)
    head_dim = q.shape[2]
    scales = (k_scale, v_scale) if k_scale is not None else None
    if k8v8 or k8v16:
        scales = (k_scale,)  # (V's scales are per channel: no descriptor reads them)
    block_d = _block_d(head_dim, k8v8 or k8v16)
    tma_ready = _descriptor_layout(k_cache, v_cache, block_d, head_dim, scales, k8v8)
    tiles = choose_tiles(
        block_size=k_cache.shape[1],
        head_dim=head_dim,
        max_seqlen_q=max_seqlen_q,
        dtype=q.dtype,
        block_m=block_m,
        block_n=block_n,
        heads_per_kv_head=q.shape[1] // k_cache.shape[2],
        dequantize=v_scale is not None,
        variant=variant,
        scores_ahead=scores_ahead,
        tma_ready=tma_ready,
        kv_dtype=k_cache.dtype,
        k8v8=k8v8,
        v_block_scales=v_block_scales,
        k8v16=k8v16,
    )
    return {**tiles, "TMA_READY": tma_ready}


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens_k: Tensor,
    *,
    max_seqlen_q: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    out: Tensor | None = None,
    key_limits: Tensor | None = None,
    key_gap: Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    variant: str | None = None,
    scores_ahead: bool | None = None,
    check_values: bool = True,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    fp8_mma: bool = False,
    int8_mma: bool = False,
    k_equalizer: Tensor | None = None,
    v_equalizer: Tensor | None = None,
    return_lse: bool = False,
    v_channel_scale: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of packed queries ``q (total_q, H, D)`` over a paged cache.

    ``key_limits`` (int32 ``(total_q,)``) caps the keys each query sees (exclusive), e.g. for
    mixed causal/full masks; ``key_gap`` (int32 ``(batch, 2)`` or ``(batch, gaps, 2)``) hides
    keys ``lo <= j < hi`` of each row, e.g. the boundary tokens of an exact window, or the
    unwritten slots between a video run that ends mid-block and the action blocks.
    ``block_m``/``block_n`` override the tile; ``variant`` the key loop (``"cp_async"``,
    ``"tma"`` or ``"ws"``; default: the launch table's choice, docs/kernels.md);
    ``scores_ahead`` whether the unmasked loop issues each tile's ``Q K^T`` a tile ahead, under
    the softmax before it (16-bit caches; default: the table's choice).
    ``check_values=False`` skips the checks that read tensor values (no device sync).

    Quantized caches (``int8`` codes, docs/quantization.md) need ``k_scale``
    and ``v_scale``, float32 ``(num_blocks, block_size, num_kv_heads)``: a slot's row reads back
    as ``codes * scale`` (scales >= 0, as ``write_slots`` writes them). By default the codes
    convert exactly to q's compute dtype, the K scale multiplies the score columns and the V
    scale the probability columns before the PV product.
    ``float8_e4m3fn`` caches with these scales (the e4m3 pool) were deleted (issue 45): they
    raise a ``ValueError`` naming the k8v16 and k8v8 formats.
    ``fp8_mma`` was deleted (issue 45): any value but False raises a ``ValueError`` naming
    the k8v8 format (``v_channel_scale`` below). Pools may have any strides;
    ``kernels.keys_major`` copies of the scale pools are read faster on a GPU (docs/kernels.md).
    ``int8_mma`` was deleted too: any value but False raises a ``ValueError`` naming the
    k8v16 format (below). ``k_equalizer``/``v_equalizer`` (quantized caches, float32
    ``(num_kv_heads, head_dim)``, as ``write_slots`` divided K and V by them): q's channels are
    multiplied by K's and the output's by V's, so the result is attention over the undivided
    rows.
    ``v_channel_scale`` (float32 ``(num_blocks, num_kv_heads, head_dim)``): the k8v8 format
    (``kernels.value_channels``; int8 ``k_cache`` with ``k_scale``, e4m3 ``v_cache``, no
    ``v_scale``): each query row rounded to int8 codes (scale ``amax / 127``), ``Q K^T`` an
    int8 MMA, the probabilities (a row's largest 448) rounded to e4m3 and ``P V`` an FP8 MMA
    over V's codes; V's channel scales multiply each tile's ``P V`` (per block: key tiles
    inside one block) or, frozen (block stride 0), the output. ``k_equalizer`` as above; no
    ``v_equalizer``.

    A query that sees no key (every key masked by ``causal``, ``key_limits`` or ``key_gap``, or
    ``seq_lens_k`` 0) outputs zeros, as FlashAttention does.

    ``return_lse=True`` returns ``(out, lse)``: ``lse`` is float32 of shape
    ``(total_q, num_heads)``, the natural log of the sum of ``exp(softmax_scale * q.k)`` over
    the keys the row sees (after every mask), ``-inf`` for a row that sees none. Partial
    attentions over disjoint key sets merge exactly by it (``merge_attention_states``). With
    quantized caches the scores are of the dequantized keys (``codes * k_scale``); with int8
    query rows (k8v8, k8v16) they are the scores the kernel used, of the rounded
    rows. Off (the default), the kernel is compiled without it.
    """
    refuse_removed(fp8_mma=fp8_mma, int8_mma=int8_mma)
    check_arguments(
        q,
        k_cache,
        v_cache,
        block_table,
        cu_seqlens_q,
        seq_lens_k,
        max_seqlen_q,
        out,
        key_limits,
        key_gap,
        check_values,
        k_scale=k_scale,
        v_scale=v_scale,
        k_equalizer=k_equalizer,
        v_equalizer=v_equalizer,
        v_channel_scale=v_channel_scale,
    )
    _checks.check_softmax_scale(softmax_scale)
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    # The kernel reads these as ptr + i (block_table's strides are passed).
    cu_seqlens_q, seq_lens_k, key_limits, key_gap = (
        _checks.contiguous_index(index) for index in (cu_seqlens_q, seq_lens_k, key_limits, key_gap)
    )
    head_dim = q.shape[2]
    if out is None:
        out = torch.empty_like(q)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    k8v8, k8v16, v_block_scales = _eight_bit_formats(k_scale, v_scale, v_channel_scale)
    tiles = call_tiles(
        q,
        k_cache,
        v_cache,
        max_seqlen_q=max_seqlen_q,
        k_scale=k_scale,
        v_scale=v_scale,
        v_channel_scale=v_channel_scale,
        block_m=block_m,
        block_n=block_n,
        variant=variant,
        scores_ahead=scores_ahead,
    )
    tma_ready = tiles.pop("TMA_READY")
    chosen_variant = tiles.pop("VARIANT")
    if tiles["TMA"] and not tma_ready:
        if variant is not None:
            raise ValueError(
                f"variant {variant!r} needs caches a tensor descriptor can read (16-byte aligned "
                "pointer and strides, unit channel stride, blocks of contiguous slots, "
                "head_dim a power of two, fewer than 2**31 slots; quantized caches: both scale "
                "pools, and k8v8's V, stored by kernels.keys_major); use 'cp_async'"
            )
        tiles["TMA"], chosen_variant = False, "cp_async"
    if chosen_variant == "ws":
        refusal = _warp_specialized_refusal(q, group, causal, key_limits, key_gap)
        if refusal and variant is not None:
            raise ValueError(f"variant 'ws' {refusal}; use 'tma'")
        if refusal:
            chosen_variant = "tma"
    lse = None
    if return_lse:
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    batch = block_table.shape[0]
    if batch == 0 or q.shape[0] == 0 or max_seqlen_q == 0:
        return (out, lse) if return_lse else out
    if use_torch_path(q):
        out = torch_path.paged_attention(
            q,
            k_cache,
            v_cache,
            block_table,
            cu_seqlens_q,
            seq_lens_k,
            softmax_scale=softmax_scale,
            causal=causal,
            out=out,
            key_limits=key_limits,
            key_gap=key_gap,
            k_scale=k_scale,
            v_scale=v_scale,
            k_equalizer=k_equalizer,
            v_equalizer=v_equalizer,
            lse=lse,
            v_channel_scale=v_channel_scale,
            k8v16=k8v16,
        )
        return (out, lse) if return_lse else out
    if scale < 0:
        # The kernel's unmasked loop takes the row max of unscaled scores: keep the scale >= 0.
        q, scale = -q, -scale
    if chosen_variant == "ws":
        return _warp_specialized(
            (q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k),
            max_seqlen_q=max_seqlen_q,
            scale=scale,
            tiles=tiles,
            out=out,
            lse=lse,
        )
    upcast = interpreter_active() or q.dtype == torch.float32
    if key_gap is not None:
        key_gap = key_gap.reshape(batch, -1, 2).contiguous()
    gaps_per_row = 1 if key_gap is None else key_gap.shape[1]
    rows = max_seqlen_q * group
    grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_M"]), batch, k_cache.shape[2])
    # Unquantized: no scale pointers (QUANTIZED is then False and the kernel is the plain one).
    if k8v8:
        # V's scale pool is its channel scales, passed as (block, channel, KV head) strides.
        v_scale = v_channel_scale
        channel_strides = v_scale.stride()
        scale_strides = (*k_scale.stride(), *channel_strides[::2], channel_strides[1])
        same_strides = k_cache.stride() == v_cache.stride()
    elif k8v16:
        v_scale = k_scale  # a placeholder: K8V16 reads no V scale
        scale_strides = (*k_scale.stride(), 0, 0, 0)
        same_strides = False
    elif k_scale is not None:
        scale_strides = (*k_scale.stride(), *v_scale.stride())
    else:
        scale_strides = (0,) * 6
    if not (k8v8 or k8v16):
        same_strides = (
            k_cache.stride() == v_cache.stride() and scale_strides[:3] == scale_strides[3:]
        )
    # int32 row offsets when every offset into the pools (and their scale pools) fits.
    pools = [pool for pool in (k_cache, v_cache, k_scale, v_scale) if pool is not None]
    offsets_32 = max(map(_largest_offset, pools)) < 2**31
    # k8v8, k8v16: the kernel loads int8 query rows made beforehand (K's factors folded in), so
    # its Q K^T MMA reads them from shared memory (kernels/query_codes.py). The dequantizing
    # modes: the unit their V scales take, for float16 operands (kernels/value_units.py).
    query, query_scales, units = q, None, None
    if k8v8 or k8v16:
        # int8 query rows (a scale per row, folded into the softmax's per-row factor).
        query, query_scales = query_codes.int8_query_rows(q, k_equalizer, group)
        k_equalizer = None
    elif k_scale is not None:
        units = value_units.probability_units(
            v_scale, block_table, seq_lens_k, key_gap, largest=value_units.FLOAT16_LARGEST
        )
    equalizer_strides = [
        factor.stride() if factor is not None else (0, 0) for factor in (k_equalizer, v_equalizer)
    ]
    if tiles["TMA"] and not interpreter_active():
        _ensure_allocator()  # the kernel makes its descriptors in global scratch memory
    _paged_attention_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        lse,
        block_table,
        cu_seqlens_q,
        seq_lens_k,
        key_limits,
        key_gap,
        k_scale,
        v_scale,
        k_equalizer,
        v_equalizer,
        query_scales,
        units,
        scale * LOG2E,
        gaps_per_row,
        k_cache.shape[0] * block_size,
        *query.stride(),
        *(query_scales.stride() if query_scales is not None else (0, 0)),
        *(units.stride() if units is not None else (0, 0)),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        *block_table.stride(),
        *scale_strides,
        *(lse.stride() if lse is not None else (0, 0)),
        *equalizer_strides[0],
        *equalizer_strides[1],
        HEAD_DIM=head_dim,
        GROUP=group,
        BLOCK_SIZE=block_size,
        SAME_KV_STRIDES=same_strides,
        OFFSETS_32=offsets_32,
        CAUSAL=causal,
        GAPS=max(1, triton.next_power_of_2(gaps_per_row)),
        V_KEYS_MAJOR=k8v8 and pool_layout.keys_aligned(v_cache),
        SCALES_KEYS_MAJOR=pool_layout.keys_aligned(k_scale)
        and (k8v8 or k8v16 or pool_layout.keys_aligned(v_scale)),
        K8V8=k8v8,
        V_BLOCK_SCALES=v_block_scales,
        K8V16=k8v16,
        PV_DTYPE=tl.float32 if upcast else tl.float16,  # quantized P V (value_units.py)
        INTERPRETED=interpreter_active(),
        UPCAST=upcast,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **tiles,
    )
    return (out, lse) if return_lse else out
