"""Varlen, non-causal (optionally causal) attention of packed queries over a paged K/V cache.

Any block size >= 1. Key position ``p`` of sequence ``i`` lives in block
``block_table[i, p // block_size]`` at offset ``p % block_size``. The block size is a
compile-time constant (a model has one), so no path divides by it at run time. A key tile of
``BLOCK_N`` rows finds its cache rows one of three ways (``KV_PATH``):

* ``contiguous``: the tile divides the block size, so one table entry gives the whole tile;
* ``two_blocks``: the block is at least a tile but not a multiple of it, so a tile spans at
  most two blocks and each row picks one of two bases;
* ``rows``: blocks smaller than the tile; each row reads its block id (a vector load), or,
  when the block divides the tile, each of the tile's blocks reads it once for all its rows.

The next tile's block ids are read one iteration ahead (loop-carried), so the software pipeliner
keeps K/V loads as many tiles ahead as in a table-free loop. Key tiles every query row of the
program sees whole run in an unmasked loop; only tiles touching ``seq_lens_k``, a row's
``key_limits``, the causal diagonal or a ``key_gap`` edge run masked, and tiles inside a gap are
skipped. Query heads sharing a KV head are packed into the M dimension, so each K/V tile is
loaded once per KV head. Online softmax in float32 (exp2, the scale folded into one FFMA),
output in ``q``'s dtype.

Quantized caches (e4m3 or int8 codes with a float32 scale per slot and KV head, DESIGN section 9)
load their code tiles and scales like the 16-bit tiles; by default the codes convert exactly to
q's compute dtype and the scales multiply score and probability columns. ``fp8_mma`` runs both
products as FP8 MMAs instead. The unquantized kernel is compiled without any of it (the scale
pointer's absence is a compile-time flag).
"""

from __future__ import annotations

import itertools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_video.kernels import _checks, quantize, torch_path
from paged_video.kernels._quantize_jit import round_to_code_grid
from paged_video.kernels._runtime import interpreter_active, use_torch_path

LOG2E = 1.4426950408889634
# ln 2 for the kernel (a global a jit function reads must be a constexpr).
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _tile_block_ids(
    table_row,
    stride_table_col,
    n_start,
    keys_end,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_PATH: tl.constexpr,
):
    """Block ids of the key tile at ``n_start``: ``(first, second, per_row)``; unused ones are 0.

    Only entries of keys below ``keys_end`` are read: padding past the sequence is never touched.
    """
    if KV_PATH == "rows":
        if BLOCK_N % BLOCK_SIZE == 0:
            # Whole blocks per tile: load each entry once and repeat it over its block's rows.
            NUM_BLOCKS: tl.constexpr = BLOCK_N // BLOCK_SIZE
            blocks = n_start // BLOCK_SIZE + tl.arange(0, NUM_BLOCKS)
            entries = table_row + blocks * stride_table_col
            per_block = tl.load(entries, mask=blocks * BLOCK_SIZE < keys_end, other=0)
            ids = tl.reshape(
                tl.broadcast_to(per_block[:, None], (NUM_BLOCKS, BLOCK_SIZE)), (BLOCK_N,)
            )
        else:
            pos = n_start + tl.arange(0, BLOCK_N)
            entries = table_row + (pos // BLOCK_SIZE) * stride_table_col
            ids = tl.load(entries, mask=pos < keys_end, other=0)
        return 0, 0, ids
    else:
        first = n_start // BLOCK_SIZE
        id0 = tl.load(table_row + first * stride_table_col, mask=n_start < keys_end, other=0)
        if KV_PATH == "two_blocks":
            edge = (first + 1) * BLOCK_SIZE
            second_needed = (edge < n_start + BLOCK_N) & (edge < keys_end)
            id1 = tl.load(table_row + (first + 1) * stride_table_col, mask=second_needed, other=0)
            return id0, id1, tl.zeros([BLOCK_N], dtype=tl.int32)
        else:
            return id0, 0, tl.zeros([BLOCK_N], dtype=tl.int32)


@triton.jit
def _tile_rows(
    id0,
    id1,
    ids,
    n_start,
    stride_block,
    stride_slot,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_PATH: tl.constexpr,
):
    """Element offsets (int64) of the tile's key rows in one cache, from its block ids.

    Tiles start at multiples of ``BLOCK_N``; the per-row parts are loop-invariant where they can
    be, so a tile costs a scalar base plus, for ``two_blocks``, one select per row.
    """
    offs_n = tl.arange(0, BLOCK_N)
    if KV_PATH == "rows":
        # When the block divides the tile, every tile's slots are the same (loop-invariant).
        shift = 0 if BLOCK_N % BLOCK_SIZE == 0 else n_start
        slot = (shift + offs_n) % BLOCK_SIZE
        rows = ids.to(tl.int64) * stride_block + slot.to(tl.int64) * stride_slot
    else:
        first_slot = n_start % BLOCK_SIZE
        base = id0.to(tl.int64) * stride_block + first_slot.to(tl.int64) * stride_slot
        rows = base + offs_n.to(tl.int64) * stride_slot
        if KV_PATH == "two_blocks":
            # Rows past the block's end move from block id0 slot BLOCK_SIZE + i to block id1
            # slot i.
            jump = (id1 - id0).to(tl.int64) * stride_block - BLOCK_SIZE * stride_slot
            # (A select here hides the rows' alignment from the pipeliner; a product does not.)
            rows += (offs_n >= BLOCK_SIZE - first_slot).to(tl.int64) * jump
    return rows


@triton.jit
def _to_e4m3(x, EXPLICIT_ROUNDING: tl.constexpr):
    """Float32 ``x`` as the nearest e4m3 code (ties to even), saturating at +-448.

    On a GPU the conversion is one ``cvt.rn.satfinite`` per pair: rounding explicitly here, in
    the hot loop, would cost ~250 instructions per tile. The interpreter's conversion rounds
    wrongly when rounding carries into the next binade (31.2 -> 16), so there
    (``EXPLICIT_ROUNDING``) x is first rounded to the code grid as the write kernel does
    (``round_to_code_grid``), and the result converts exactly.
    """
    if EXPLICIT_ROUNDING:
        x = round_to_code_grid(tl.minimum(tl.maximum(x, -448.0), 448.0), True)
    return x.to(tl.float8e4nv)


@triton.jit
def _attend_tiles(
    acc,
    row_max,
    row_sum,
    acc_scale,
    q,
    k_head_ptr,
    v_head_ptr,
    ks_head_ptr,
    vs_head_ptr,
    table_row,
    stride_table_col,
    first_tile,
    tiles_start,
    num_tiles,
    keys_lo,
    keys_hi,
    key_limit,
    scale_log2,
    stride_k_block,
    stride_k_slot,
    stride_k_dim,
    stride_v_block,
    stride_v_slot,
    stride_v_dim,
    stride_ks_block,
    stride_ks_slot,
    stride_vs_block,
    stride_vs_slot,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_PATH: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    MASKED: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,
    FP8_MMA: tl.constexpr,
    EXPLICIT_ROUNDING: tl.constexpr,
):
    """Online softmax over ``num_tiles`` key tiles: tile 0 starts at ``first_tile``, tile j > 0
    at ``tiles_start + (j - 1) * BLOCK_N``.

    ``MASKED``: only keys in ``[keys_lo, keys_hi)`` are loaded and a row sees keys below its
    ``key_limit``. Unmasked: every row sees every key of every tile. ``scale_log2`` is a scalar,
    or per row (``FP8_MMA``: the query rows' scales folded in); it must be >= 0.

    ``QUANTIZED``: K/V tiles are codes with a scale per key row (loaded like the tile's rows, from
    the scale pools). The K scales multiply the score columns; the V scales the probability
    columns before the PV product (row sums from the unscaled probabilities). Without
    ``FP8_MMA`` the codes convert exactly to q's compute dtype; with it, q is already e4m3 codes,
    both products are FP8 MMAs, and the V-scaled probabilities are rounded to e4m3 after
    normalising by the tile's largest V scale (times 448, so they span the format).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_dims = k_head_ptr + offs_d[None, :] * stride_k_dim
    v_dims = v_head_ptr + offs_d[None, :] * stride_v_dim
    d_mask = offs_d[None, :] < HEAD_DIM
    row_scale = scale_log2[:, None] if FP8_MMA else scale_log2
    id0, id1, ids = _tile_block_ids(
        table_row, stride_table_col, first_tile, keys_hi, BLOCK_N, BLOCK_SIZE, KV_PATH
    )
    for j in range(0, num_tiles):
        if MASKED:
            n_start = tl.where(j == 0, first_tile, tiles_start + (j - 1) * BLOCK_N)
        else:
            n_start = first_tile + j * BLOCK_N
        # The next tile's block ids first: its K/V addresses are known a whole iteration early.
        next_id0, next_id1, next_ids = _tile_block_ids(
            table_row,
            stride_table_col,
            tiles_start + j * BLOCK_N,
            keys_hi,
            BLOCK_N,
            BLOCK_SIZE,
            KV_PATH,
        )
        k_rows = _tile_rows(
            id0, id1, ids, n_start, stride_k_block, stride_k_slot, BLOCK_N, BLOCK_SIZE, KV_PATH
        )
        if SAME_KV_STRIDES and KV_PATH != "contiguous":
            v_rows = k_rows
        else:
            v_rows = _tile_rows(
                id0, id1, ids, n_start, stride_v_block, stride_v_slot, BLOCK_N, BLOCK_SIZE, KV_PATH
            )
        if QUANTIZED:
            ks_rows = _tile_rows(
                id0,
                id1,
                ids,
                n_start,
                stride_ks_block,
                stride_ks_slot,
                BLOCK_N,
                BLOCK_SIZE,
                KV_PATH,
            )
            if SAME_KV_STRIDES and KV_PATH != "contiguous":
                vs_rows = ks_rows
            else:
                vs_rows = _tile_rows(
                    id0,
                    id1,
                    ids,
                    n_start,
                    stride_vs_block,
                    stride_vs_slot,
                    BLOCK_N,
                    BLOCK_SIZE,
                    KV_PATH,
                )
        if MASKED:
            keys = n_start + offs_n
            n_mask = (keys >= keys_lo) & (keys < keys_hi)
            # Hidden keys are never loaded: they may be unwritten slots holding NaN.
            k = tl.load(k_dims + k_rows[:, None], mask=n_mask[:, None] & d_mask, other=0.0)
            v = tl.load(v_dims + v_rows[:, None], mask=n_mask[:, None] & d_mask, other=0.0)
            if QUANTIZED:
                k_col = tl.load(ks_head_ptr + ks_rows, mask=n_mask, other=0.0)
                v_col = tl.load(vs_head_ptr + vs_rows, mask=n_mask, other=0.0)
        elif HEAD_DIM == BLOCK_D:
            k = tl.load(k_dims + k_rows[:, None])
            v = tl.load(v_dims + v_rows[:, None])
            if QUANTIZED:
                k_col = tl.load(ks_head_ptr + ks_rows)
                v_col = tl.load(vs_head_ptr + vs_rows)
        else:
            k = tl.load(k_dims + k_rows[:, None], mask=d_mask, other=0.0)
            v = tl.load(v_dims + v_rows[:, None], mask=d_mask, other=0.0)
            if QUANTIZED:
                k_col = tl.load(ks_head_ptr + ks_rows)
                v_col = tl.load(vs_head_ptr + vs_rows)
        if FP8_MMA:
            qk = tl.dot(q, tl.trans(k))
        else:
            if QUANTIZED:
                # Codes are exact in every compute dtype (e4m3: 4 significant bits, int8: 7).
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            elif UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if QUANTIZED:
            qk = qk * k_col[None, :]
        if MASKED:
            visible = n_mask[None, :] & (keys[None, :] < key_limit[:, None])
            scores = tl.where(visible, qk * row_scale, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, axis=1))
            # A row that has seen no visible key yet keeps max -inf; subtract 0 instead of
            # -inf so exp2 gives 0, not NaN.
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            probs = tl.math.exp2(scores - safe_max[:, None])
            rescale = tl.math.exp2(row_max - safe_max)
        else:
            # scale_log2 >= 0 (the launcher makes it so): max(qk) * scale is the scaled max,
            # and qk * scale - max is one FFMA per score.
            new_max = tl.maximum(row_max, tl.max(qk, axis=1) * scale_log2)
            probs = tl.math.exp2(qk * row_scale - new_max[:, None])
            rescale = tl.math.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        if FP8_MMA:
            # max(v_col) > 0 unless the tile's V rows are all zero (then so is the product).
            v_max = tl.max(v_col, axis=0)
            v_max = tl.where(v_max > 0.0, v_max, 1.0)
            p_codes = _to_e4m3(probs * (v_col * (448.0 / v_max))[None, :], EXPLICIT_ROUNDING)
            # acc holds the output in units of acc_scale: this tile's unit folds into the
            # rescale, so the MMA accumulates in place (no multiply per output element).
            tile_scale = v_max / 448.0
            acc = acc * (rescale * (acc_scale / tile_scale))[:, None] + tl.dot(p_codes, v)
            acc_scale = tile_scale
        else:
            if QUANTIZED:
                probs = probs * v_col[None, :]
            pv = tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
            acc = acc * rescale[:, None] + pv
        row_max = new_max
        id0, id1, ids = next_id0, next_id1, next_ids
    return acc, row_max, row_sum, acc_scale


@triton.jit
def _attend_run(
    acc,
    row_max,
    row_sum,
    acc_scale,
    q,
    k_head_ptr,
    v_head_ptr,
    ks_head_ptr,
    vs_head_ptr,
    table_row,
    stride_table_col,
    run_lo,
    run_hi,
    full_end,
    key_limit,
    scale_log2,
    stride_k_block,
    stride_k_slot,
    stride_k_dim,
    stride_v_block,
    stride_v_slot,
    stride_v_dim,
    stride_ks_block,
    stride_ks_slot,
    stride_vs_block,
    stride_vs_slot,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_PATH: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,
    FP8_MMA: tl.constexpr,
    EXPLICIT_ROUNDING: tl.constexpr,
):
    """Keys ``[run_lo, run_hi)``, visible to rows up to their limits; every row sees all keys
    below ``full_end``. Whole tiles inside ``[run_lo, min(run_hi, full_end))`` run unmasked; the
    tile holding ``run_lo`` and the tiles from the unmasked ones' end to ``run_hi`` run masked."""
    head_tile = run_lo // BLOCK_N * BLOCK_N
    tiles_end = tl.cdiv(run_hi, BLOCK_N) * BLOCK_N
    full_lo = tl.cdiv(run_lo, BLOCK_N) * BLOCK_N
    full_hi = tl.maximum(full_lo, tl.minimum(run_hi, full_end) // BLOCK_N * BLOCK_N)
    acc, row_max, row_sum, acc_scale = _attend_tiles(
        acc,
        row_max,
        row_sum,
        acc_scale,
        q,
        k_head_ptr,
        v_head_ptr,
        ks_head_ptr,
        vs_head_ptr,
        table_row,
        stride_table_col,
        full_lo,
        full_lo + BLOCK_N,
        (full_hi - full_lo) // BLOCK_N,
        run_lo,
        run_hi,
        key_limit,
        scale_log2,
        stride_k_block,
        stride_k_slot,
        stride_k_dim,
        stride_v_block,
        stride_v_slot,
        stride_v_dim,
        stride_ks_block,
        stride_ks_slot,
        stride_vs_block,
        stride_vs_slot,
        BLOCK_N,
        BLOCK_D,
        HEAD_DIM,
        BLOCK_SIZE,
        KV_PATH,
        SAME_KV_STRIDES,
        False,
        UPCAST,
        DOT_PRECISION,
        QUANTIZED,
        FP8_MMA,
        EXPLICIT_ROUNDING,
    )
    # Masked: the head tile when the run starts mid-tile (and it is not also the tail), then
    # the tail from the unmasked tiles' end.
    has_head = (head_tile < full_lo) & (full_lo <= tiles_end)
    tail_start = tl.maximum(full_hi, tl.minimum(full_lo, tiles_end))
    tail_tiles = tl.maximum(tiles_end - tail_start, 0) // BLOCK_N
    if has_head:
        first_tile = head_tile
        num_masked = tail_tiles + 1
    else:
        first_tile = tail_start
        num_masked = tail_tiles
        tail_start = tail_start + BLOCK_N
    acc, row_max, row_sum, acc_scale = _attend_tiles(
        acc,
        row_max,
        row_sum,
        acc_scale,
        q,
        k_head_ptr,
        v_head_ptr,
        ks_head_ptr,
        vs_head_ptr,
        table_row,
        stride_table_col,
        first_tile,
        tail_start,
        num_masked,
        run_lo,
        run_hi,
        key_limit,
        scale_log2,
        stride_k_block,
        stride_k_slot,
        stride_k_dim,
        stride_v_block,
        stride_v_slot,
        stride_v_dim,
        stride_ks_block,
        stride_ks_slot,
        stride_vs_block,
        stride_vs_slot,
        BLOCK_N,
        BLOCK_D,
        HEAD_DIM,
        BLOCK_SIZE,
        KV_PATH,
        SAME_KV_STRIDES,
        True,
        UPCAST,
        DOT_PRECISION,
        QUANTIZED,
        FP8_MMA,
        EXPLICIT_ROUNDING,
    )
    return acc, row_max, row_sum, acc_scale


@triton.heuristics(
    {
        "HAS_KEY_LIMITS": lambda args: args["key_limits_ptr"] is not None,
        "HAS_KEY_GAP": lambda args: args["key_gap_ptr"] is not None,
        "QUANTIZED": lambda args: args["k_scale_ptr"] is not None,
        "HAS_LSE": lambda args: args["lse_ptr"] is not None,
    }
)
@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    block_table_ptr,
    cu_seqlens_q_ptr,
    seq_lens_k_ptr,
    key_limits_ptr,
    key_gap_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2,
    gaps_per_row,
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_k_dim,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_v_dim,
    stride_o_tok,
    stride_o_head,
    stride_o_dim,
    stride_table_row,
    stride_table_col,
    stride_ks_block,
    stride_ks_slot,
    stride_ks_head,
    stride_vs_block,
    stride_vs_slot,
    stride_vs_head,
    stride_lse_tok,
    stride_lse_head,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_PATH: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_KEY_LIMITS: tl.constexpr,
    HAS_KEY_GAP: tl.constexpr,
    GAPS: tl.constexpr,
    QUANTIZED: tl.constexpr,
    FP8_MMA: tl.constexpr,
    EXPLICIT_ROUNDING: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    """Program (m, i, h): rows m*BLOCK_M.. of sequence i's (query, head of KV head h) pairs.

    Row r is query r // GROUP of the sequence, query head h * GROUP + r % GROUP.
    """
    tile_m = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile_m * BLOCK_M >= q_len * GROUP:
        return
    k_len = tl.load(seq_lens_k_ptr + seq)

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    query = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    m_mask = query < q_len
    io_mask = m_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    q_rows = (q_start + query).to(tl.int64)
    q = tl.load(
        q_ptr
        + q_rows[:, None] * stride_q_tok
        + head[:, None].to(tl.int64) * stride_q_head
        + offs_d[None, :] * stride_q_dim,
        mask=io_mask,
        other=0.0,
    )
    if FP8_MMA:
        # Each row as e4m3 codes and a scale (amax / 448), folded into the softmax scale.
        q = q.to(tl.float32)
        q_scale = tl.max(tl.abs(q), axis=1) / 448.0
        q = _to_e4m3(q / tl.where(q_scale > 0.0, q_scale, 1.0)[:, None], EXPLICIT_ROUNDING)
        scale_log2 = q_scale * scale_log2
    elif UPCAST:
        q = q.to(tl.float32)

    # Exclusive upper bound on the keys each row sees; rows past q_len see nothing and do not
    # count for the keys every row sees whole.
    key_limit = tl.zeros([BLOCK_M], dtype=tl.int32) + k_len
    if CAUSAL:
        key_limit = tl.minimum(key_limit, query + (k_len - q_len) + 1)
    if HAS_KEY_LIMITS:
        row_limits = tl.load(key_limits_ptr + q_start + query, mask=m_mask, other=0)
        key_limit = tl.minimum(key_limit, row_limits)
    key_limit = tl.maximum(tl.where(m_mask, key_limit, 0), 0)
    keys_end = tl.max(key_limit, axis=0)
    full_end = tl.min(tl.where(m_mask, key_limit, keys_end), axis=0)

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc_scale = 1.0  # FP8_MMA: acc is the output in units of acc_scale
    table_row = block_table_ptr + seq.to(tl.int64) * stride_table_row
    k_head_ptr = k_ptr + kv_head.to(tl.int64) * stride_k_head
    v_head_ptr = v_ptr + kv_head.to(tl.int64) * stride_v_head
    if QUANTIZED:
        ks_head_ptr = k_scale_ptr + kv_head.to(tl.int64) * stride_ks_head
        vs_head_ptr = v_scale_ptr + kv_head.to(tl.int64) * stride_vs_head
    else:
        ks_head_ptr = k_scale_ptr
        vs_head_ptr = v_scale_ptr

    if HAS_KEY_GAP:
        # Up to GAPS hidden ranges [lo, hi) per row, in any order, possibly overlapping; missing
        # ones load as the empty [0, 0). Visible runs between gaps are attended one by one.
        offs_g = tl.arange(0, GAPS)
        g_mask = offs_g < gaps_per_row
        gap_row = key_gap_ptr + seq * 2 * gaps_per_row + 2 * offs_g
        gap_lo = tl.load(gap_row, mask=g_mask, other=0)
        gap_hi = tl.load(gap_row + 1, mask=g_mask, other=0)
        gap_lo = tl.where(gap_lo < gap_hi, gap_lo, keys_end)
        gap_hi = tl.where(gap_lo < gap_hi, gap_hi, keys_end)
        run_lo = k_len * 0
        while run_lo < keys_end:
            ahead = gap_hi > run_lo
            run_hi = tl.min(tl.where(ahead, tl.maximum(gap_lo, run_lo), keys_end), axis=0)
            run_hi = tl.minimum(run_hi, keys_end)
            acc, row_max, row_sum, acc_scale = _attend_run(
                acc,
                row_max,
                row_sum,
                acc_scale,
                q,
                k_head_ptr,
                v_head_ptr,
                ks_head_ptr,
                vs_head_ptr,
                table_row,
                stride_table_col,
                run_lo,
                run_hi,
                full_end,
                key_limit,
                scale_log2,
                stride_k_block,
                stride_k_slot,
                stride_k_dim,
                stride_v_block,
                stride_v_slot,
                stride_v_dim,
                stride_ks_block,
                stride_ks_slot,
                stride_vs_block,
                stride_vs_slot,
                BLOCK_N,
                BLOCK_D,
                HEAD_DIM,
                BLOCK_SIZE,
                KV_PATH,
                SAME_KV_STRIDES,
                UPCAST,
                DOT_PRECISION,
                QUANTIZED,
                FP8_MMA,
                EXPLICIT_ROUNDING,
            )
            # Skip the union of the gaps that cover run_hi.
            for _ in tl.static_range(GAPS):
                covering = (gap_lo <= run_hi) & (gap_hi > run_hi)
                run_hi = tl.max(tl.where(covering, gap_hi, run_hi), axis=0)
            run_lo = run_hi
    else:
        acc, row_max, row_sum, acc_scale = _attend_run(
            acc,
            row_max,
            row_sum,
            acc_scale,
            q,
            k_head_ptr,
            v_head_ptr,
            ks_head_ptr,
            vs_head_ptr,
            table_row,
            stride_table_col,
            k_len * 0,
            keys_end,
            full_end,
            key_limit,
            scale_log2,
            stride_k_block,
            stride_k_slot,
            stride_k_dim,
            stride_v_block,
            stride_v_slot,
            stride_v_dim,
            stride_ks_block,
            stride_ks_slot,
            stride_vs_block,
            stride_vs_slot,
            BLOCK_N,
            BLOCK_D,
            HEAD_DIM,
            BLOCK_SIZE,
            KV_PATH,
            SAME_KV_STRIDES,
            UPCAST,
            DOT_PRECISION,
            QUANTIZED,
            FP8_MMA,
            EXPLICIT_ROUNDING,
        )

    if FP8_MMA:
        acc = acc * acc_scale
    # A query with no visible key outputs zeros, as FlashAttention does.
    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    tl.store(
        out_ptr
        + q_rows[:, None] * stride_o_tok
        + head[:, None].to(tl.int64) * stride_o_head
        + offs_d[None, :] * stride_o_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )
    if HAS_LSE:
        # row_max and the scores are in log2 units (the scale folds in log2(e)): the row sums
        # are of exp2(score - row_max), so the natural-log LSE is (row_max + log2(sum)) * ln 2.
        # A row that saw no key kept row_max -inf (and sum 0, read as 1 here so that no log of
        # 0 is taken): its LSE is -inf, its output zeros.
        lse = (row_max + tl.math.log2(tl.where(row_sum > 0.0, row_sum, 1.0))) * LN2
        tl.store(
            lse_ptr + q_rows * stride_lse_tok + head.to(tl.int64) * stride_lse_head,
            lse,
            mask=m_mask,
        )


def _is_tile(value: int) -> bool:
    return value >= 16 and value & (value - 1) == 0


# GPU launch settings per (head_dim up to, 16-bit or fp32): BLOCK_M, BLOCK_N, warps, stages.
# Checked for registers, spills and pipelining by `python -m paged_video.bench compile`.
_GPU_TILES: dict[tuple[int, bool], tuple[int, int, int, int]] = {
    (64, True): (128, 64, 8, 3),
    (128, True): (128, 64, 8, 3),
    (256, True): (64, 32, 8, 2),
    (64, False): (64, 32, 4, 2),
    (128, False): (64, 32, 4, 2),
    (256, False): (64, 32, 4, 2),
}


# Quantized caches at the 128 x 64 tile, hd 128, bf16
# (`python -m paged_video.bench compile --kv-modes fp8,int8,fp8_mma`): Triton 3.9 fits them in
# 255 registers (spills of 8-28 bytes at some block sizes), Triton 3.6 spills 250-480 bytes; with
# 32-key tiles 3.6 does not spill (dequantizing) or spills 8-12 bytes (FP8 MMA).
_QUANTIZED_BLOCK_N_OLD_TRITON = 32
_OLD_TRITON = tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 9)


def kv_path(block_size: int, block_n: int) -> str:
    """How a key tile of ``block_n`` rows finds its rows in blocks of ``block_size``."""
    if block_size % block_n == 0:
        return "contiguous"
    return "two_blocks" if block_size >= block_n else "rows"


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
    fp8_mma: bool = False,
) -> dict[str, int | str]:
    """Tile sizes, key path and launch settings for one call, with the caller's overrides.

    A tile's M rows are (query, head) pairs of one KV head, so ``heads_per_kv_head`` times the
    queries. Under the interpreter every program is a batch of numpy ops, so big tiles are much
    faster. On a GPU the settings come from a small table per (head_dim, dtype).
    ``dequantize``: K/V codes converted to ``dtype`` before the MMAs. Triton's pipeliner then
    keeps loads one stage closer to their use (they feed a conversion, not the MMA), so one more
    stage keeps as many K/V tiles in flight (checked by ``python -m paged_video.bench compile``).
    ``fp8_mma``: FP8 MMAs on e4m3 codes. Before Triton 3.9 either quantized mode takes 32-key
    tiles (register pressure).
    """
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value is not None and (not isinstance(value, int) or not _is_tile(value)):
            raise ValueError(f"{name} must be a power of two >= 16, got {value!r}")
    rows = max(1, max_seqlen_q) * max(1, heads_per_kv_head)
    short_q = max(16, triton.next_power_of_2(rows))
    if interpreter_active():
        # 1024 x 512 scores stay under Triton's 2**20-element block limit.
        default_m, default_n, warps, stages = min(1024, short_q), 512, 4, 1
    else:
        dim_class = next(d for d in (64, 128, 256) if head_dim <= d)
        default_m, default_n, warps, stages = _GPU_TILES[(dim_class, dtype != torch.float32)]
        if short_q < default_m:
            default_m, warps = short_q, 4
        stages += dequantize
        if (dequantize or fp8_mma) and _OLD_TRITON:
            default_n = min(default_n, _QUANTIZED_BLOCK_N_OLD_TRITON)
    tile_m = block_m or default_m
    tile_n = block_n or default_n
    return {
        "BLOCK_M": tile_m,
        "BLOCK_N": tile_n,
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "KV_PATH": kv_path(block_size, tile_n),
        "num_warps": warps,
        "num_stages": stages,
    }


def _check_arguments(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens_k: Tensor,
    max_seqlen_q: int,
    out: Tensor | None,
    key_limits: Tensor | None,
    key_gap: Tensor | None,
    check_values: bool,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    fp8_mma: bool = False,
) -> None:
    _checks.check_rank("q", q, 3, "(total_q, num_heads, head_dim)")
    layout = "(num_blocks, block_size, num_kv_heads, head_dim)"
    _checks.check_rank("k_cache", k_cache, 4, layout)
    _checks.check_rank("v_cache", v_cache, 4, layout)
    _checks.check_rank("block_table", block_table, 2, "(batch, width)")
    _checks.check_rank("cu_seqlens_q", cu_seqlens_q, 1, "(batch + 1,)")
    _checks.check_rank("seq_lens_k", seq_lens_k, 1, "(batch,)")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None:
            _checks.check_tensor(name, scale)
    _checks.check_same_device(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens_k=seq_lens_k,
        out=out,
        key_limits=key_limits,
        key_gap=key_gap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    _checks.check_dtype("q", q, _checks.FLOAT_DTYPES)
    _check_cache_dtypes(q, k_cache, v_cache, fp8_mma)
    quantize.check_scales("k_scale", k_scale, "k_cache", k_cache)
    quantize.check_scales("v_scale", v_scale, "v_cache", v_cache)
    for name, index in (
        ("block_table", block_table),
        ("cu_seqlens_q", cu_seqlens_q),
        ("seq_lens_k", seq_lens_k),
    ):
        _checks.check_dtype(name, index, (torch.int32,))
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    _checks.check_head_dim("q", head_dim)
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache head_dim {k_cache.shape[3]} must equal q head_dim {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"q num_heads {num_heads} must be a multiple of k_cache num_kv_heads {num_kv_heads}"
        )
    batch = block_table.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(
            f"cu_seqlens_q must have shape ({batch + 1},) for a block_table of {batch} rows, "
            f"got {tuple(cu_seqlens_q.shape)}"
        )
    if seq_lens_k.shape[0] != batch:
        raise ValueError(f"seq_lens_k must have shape ({batch},), got {tuple(seq_lens_k.shape)}")
    _checks.check_int("max_seqlen_q", max_seqlen_q, minimum=0)
    if out is not None:
        _checks.check_tensor("out", out)
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(
                f"out must match q: shape {tuple(q.shape)} dtype {q.dtype}, "
                f"got {tuple(out.shape)} {out.dtype}"
            )
    if key_limits is not None:
        _checks.check_rank("key_limits", key_limits, 1, "(total_q,)")
        _checks.check_dtype("key_limits", key_limits, (torch.int32,))
        if key_limits.shape[0] != q.shape[0]:
            raise ValueError(
                f"key_limits must have shape ({q.shape[0]},), got {tuple(key_limits.shape)}"
            )
    if key_gap is not None:
        _checks.check_tensor("key_gap", key_gap)
        _checks.check_dtype("key_gap", key_gap, (torch.int32,))
        if key_gap.dim() not in (2, 3) or key_gap.shape[0] != batch or key_gap.shape[-1] != 2:
            raise ValueError(
                f"key_gap must have shape ({batch}, 2) or ({batch}, gaps, 2), "
                f"got {tuple(key_gap.shape)}"
            )
    if check_values:
        _check_values(q, k_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_q)


def _check_cache_dtypes(q: Tensor, k_cache: Tensor, v_cache: Tensor, fp8_mma: object) -> None:
    """Caches in q's dtype, or both in one quantized dtype; ``fp8_mma`` only for e4m3 caches."""
    if not isinstance(fp8_mma, bool):
        raise TypeError(f"fp8_mma must be a bool, got {type(fp8_mma).__name__}")
    if quantize.is_quantized(k_cache.dtype):
        if v_cache.dtype != k_cache.dtype:
            raise TypeError(
                f"v_cache must have k_cache's quantized dtype {k_cache.dtype}, got {v_cache.dtype}"
            )
    else:
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if cache.dtype != q.dtype:
                allowed = ", ".join(str(d) for d in quantize.QUANT_DTYPES)
                raise TypeError(
                    f"{name} must have q's dtype {q.dtype} or a quantized one ({allowed}), "
                    f"got {cache.dtype}"
                )
    if fp8_mma and k_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_mma needs float8_e4m3fn caches, got {k_cache.dtype}")


def _check_values(
    q: Tensor,
    k_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens_k: Tensor,
    max_seqlen_q: int,
) -> None:
    """Checks that read tensor values (one device sync); the fused op skips them."""
    starts = cu_seqlens_q.tolist()
    if starts[0] != 0 or starts[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens_q must run from 0 to total_q={q.shape[0]}, got {starts}")
    q_lens = [b - a for a, b in itertools.pairwise(starts)]
    if any(length < 0 for length in q_lens):
        raise ValueError(f"cu_seqlens_q must be non-decreasing, got {starts}")
    if q_lens and max(q_lens) > max_seqlen_q:
        raise ValueError(f"max_seqlen_q={max_seqlen_q} is below the longest query {max(q_lens)}")
    lengths = seq_lens_k.tolist()
    if any(length < 0 for length in lengths):
        raise ValueError(f"seq_lens_k must be >= 0, got {lengths}")
    block_size = k_cache.shape[1]
    needed = max((math.ceil(length / block_size) for length in lengths), default=0)
    if needed > block_table.shape[1]:
        raise ValueError(
            f"block_table width {block_table.shape[1]} is too narrow: seq_lens_k needs {needed} "
            f"blocks of {block_size}"
        )
    for row, length in enumerate(lengths):
        used = block_table[row, : math.ceil(length / block_size)]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= k_cache.shape[0]):
            raise ValueError(
                f"block_table row {row} points outside the cache's {k_cache.shape[0]} blocks"
            )


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
    check_values: bool = True,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    fp8_mma: bool = False,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of packed queries ``q (total_q, H, D)`` over a paged cache.

    ``key_limits`` (int32 ``(total_q,)``) caps the keys each query sees (exclusive), e.g. for
    mixed causal/full masks; ``key_gap`` (int32 ``(batch, 2)`` or ``(batch, gaps, 2)``) hides
    keys ``lo <= j < hi`` of each row, e.g. the boundary tokens of an exact window, or the
    unwritten slots between a video run that ends mid-block and the action blocks.
    ``block_m``/``block_n`` override the tile. ``check_values=False`` skips the checks that
    read tensor values (no device sync).

    Quantized caches (``float8_e4m3fn`` or ``int8`` codes, DESIGN section 9) need ``k_scale``
    and ``v_scale``, float32 ``(num_blocks, block_size, num_kv_heads)``: a slot's row reads back
    as ``codes * scale`` (scales >= 0, as ``write_slots`` writes them). By default the codes
    convert exactly to q's compute dtype, the K scale multiplies the score columns and the V
    scale the probability columns before the PV product.
    ``fp8_mma=True`` (e4m3 caches only) rounds each query row and the V-scaled probabilities to
    e4m3 and runs both products as FP8 MMAs with float32 accumulation.

    A query that sees no key (every key masked by ``causal``, ``key_limits`` or ``key_gap``, or
    ``seq_lens_k`` 0) outputs zeros, as FlashAttention does.

    ``return_lse=True`` returns ``(out, lse)``: ``lse`` is float32 of shape
    ``(total_q, num_heads)``, the natural log of the sum of ``exp(softmax_scale * q.k)`` over
    the keys the row sees (after every mask), ``-inf`` for a row that sees none. Partial
    attentions over disjoint key sets merge exactly by it (``merge_attention_states``). With
    quantized caches the scores are of the dequantized keys (``codes * k_scale``); with
    ``fp8_mma`` they are the scores the kernel used, of the e4m3-rounded query rows. Off (the
    default), the kernel is compiled without it.
    """
    _check_arguments(
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
        fp8_mma=fp8_mma,
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
    tiles = choose_tiles(
        block_size=block_size,
        head_dim=head_dim,
        max_seqlen_q=max_seqlen_q,
        dtype=q.dtype,
        block_m=block_m,
        block_n=block_n,
        heads_per_kv_head=group,
        dequantize=k_scale is not None and not fp8_mma,
        fp8_mma=fp8_mma,
    )
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
            fp8_mma=fp8_mma,
            lse=lse,
        )
        return (out, lse) if return_lse else out
    if scale < 0:
        # The kernel's unmasked loop takes the row max of unscaled scores: keep the scale >= 0.
        q, scale = -q, -scale
    upcast = interpreter_active() or q.dtype == torch.float32
    if key_gap is not None:
        key_gap = key_gap.reshape(batch, -1, 2).contiguous()
    gaps_per_row = 1 if key_gap is None else key_gap.shape[1]
    rows = max_seqlen_q * group
    grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_M"]), batch, k_cache.shape[2])
    # Unquantized: no scale pointers (QUANTIZED is then False and the kernel is the plain one).
    scale_strides = (*k_scale.stride(), *v_scale.stride()) if k_scale is not None else (0,) * 6
    same_strides = k_cache.stride() == v_cache.stride() and scale_strides[:3] == scale_strides[3:]
    _paged_attention_kernel[grid](
        q,
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
        scale * LOG2E,
        gaps_per_row,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        *block_table.stride(),
        *scale_strides,
        *(lse.stride() if lse is not None else (0, 0)),
        HEAD_DIM=head_dim,
        GROUP=group,
        BLOCK_SIZE=block_size,
        SAME_KV_STRIDES=same_strides,
        CAUSAL=causal,
        GAPS=max(1, triton.next_power_of_2(gaps_per_row)),
        FP8_MMA=fp8_mma,
        EXPLICIT_ROUNDING=interpreter_active(),
        UPCAST=upcast,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **tiles,
    )
    return (out, lse) if return_lse else out
