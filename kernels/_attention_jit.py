"""The paged attention kernel's Triton code (the launcher is ``kernels/paged_attention.py``).

Any block size >= 1. Key position ``p`` of sequence ``i`` lives in block
``block_table[i, p // block_size]`` at offset ``p % block_size``. The block size is a
compile-time constant (a model has one), so no path divides by it at run time. A key tile of
``BLOCK_N`` rows finds its cache rows one of four ways (``KV_PATH``):

* ``contiguous``: the tile divides the block size, so one table entry gives the whole tile;
* ``block_tiles``: each block is cut into pieces (``PIECES``) whose keys fill tiles without
  straddling a piece, and the keys of each piece (over all blocks, in block order: "piece
  positions") are tiled and attended in loops of their own; softmax does not depend on the
  order keys are seen in. A block larger than the tile is cut after its whole tiles (its
  first piece reads as the contiguous path, one entry per tile; the remainder, at most a
  quarter of the block, runs masked only, an entry per row); otherwise the rest (or a smaller
  block that does not divide the tile) is cut into its powers of two, up to eight pieces in
  all (24 = 16 + 8, 7 = 4 + 2 + 1, 100 = 64 + 32 + 4 at 64-key tiles), so a tile holds whole
  pieces and reads one entry per piece (``kernels.paged_attention.block_pieces``): at tiles up
  to 128 keys, every block that neither divides the tile nor is a multiple of it;
* ``two_blocks`` (tiles of 256 keys or more): the block is at least a tile but not a multiple
  of it, and its remainder (more than a quarter of it) cuts into more pieces than that, so a
  tile spans at most two blocks and each row picks one of two bases;
* ``rows``: blocks smaller than the tile; when the block divides the tile, each of the tile's
  blocks reads its id once for all its rows; otherwise (tiles of 512 keys or more) each row
  reads its block id (a vector load).

The next tile's block ids are read one iteration ahead (loop-carried), so the software pipeliner
keeps K/V loads as many tiles ahead as in a table-free loop. With ``TMA`` the unmasked loop of
the contiguous and ``block_tiles`` paths loads each K/V tile with one tensor-descriptor load
(descriptors made on the device over the pool seen as (block * slot) rows of (KV head *
channel) columns; a keys-major V as (block * KV head * channel) rows of slots; keys-major
scale pools as one run of scales, a tile's scales one load), the 16-bit and the quantized
caches alike; masked tiles keep pointer loads, which skip hidden keys. Key tiles every
query row of the program sees whole run in an unmasked loop; only tiles touching
``seq_lens_k``, a row's ``key_limits``, the causal diagonal or a ``key_gap`` edge run masked
(masked tiles over 64 keys at half the tile), and tiles inside a gap are skipped.
Query heads sharing a KV head are packed into the M dimension, so each K/V tile is loaded
once per KV head. Online softmax in float32 (exp2, the scale folded into one FFMA), output in
``q``'s dtype; optionally each row's log-sum-exp (``HAS_LSE``).

Quantized caches (int8 codes with a float32 scale per slot and KV head) load their code tiles
and scales like the 16-bit tiles; by default K's codes convert exactly to q's compute dtype
(int8 K under a bfloat16 q, up to 128 channels: float16, the query rows scaled into it by a
power of two each), V's to float16, and the scales multiply score columns (K) and V's rows
(probability columns in masked tiles), in a unit per sequence and KV head the launcher made
beforehand (``v_unit_ptr``), so that float16 holds them. Channel equalization factors
(``HAS_K_EQUALIZER``, ``HAS_V_EQUALIZER``) multiply q's channels before anything else (k8v8's and
k8v16's query codes have K's in) and the output's at the end.
The unquantized kernel is compiled without any of it (the scale pointer's absence is a
compile-time flag), as the kernel without ``HAS_LSE`` is without the LSE.
"""

from __future__ import annotations

import triton
import triton.language as tl

from paged_video.kernels._quantize_jit import int8_to_float16, to_e4m3

# ln 2 for the kernel (a global a jit function reads must be a constexpr).
LN2 = tl.constexpr(0.6931471805599453)
# log2(448): k8v8's probabilities are exp2(score - row max + this), at most 448.
LOG2_E4M3_MAX = tl.constexpr(8.807354922057604)
# 1.5 * 2**23 and its float32 bits (0x4B400000): an int32 s with |s| < 2**22 added to the bits
# reads as the float SCORE_BIAS + s, exactly (_biased_scores).
SCORE_BIAS = tl.constexpr(12582912.0)
SCORE_BIAS_BITS = tl.constexpr(1262485504)
# k8v8's row sums: the columns of the FP8 MMA that sums each tile's e4m3 probabilities over a
# column of ones (_sums_operand); 16, a warpgroup MMA's on both Tritons (at 8, Triton 3.6 took
# an HMMA, 683 instructions a 128-key tile at block 1560 against 645).
SUM_COLUMNS = tl.constexpr(16)


@triton.jit
def _tile_block_ids(
    table_row,
    stride_table_col,
    n_start,
    positions_end,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_PATH: tl.constexpr,
    PIECE_OFFSET: tl.constexpr,
    PIECE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    WHOLE_TILE: tl.constexpr,
):
    """Block ids of the key tile at piece position ``n_start`` (``_attend_run``): ``(first,
    second, per_row)``; unused ones are 0. ``MASKED``: the tile is a masked loop's.
    ``WHOLE_TILE`` (asked for by the unmasked 16-bit loops): every entry of the tile is needed
    (or, for the prefetch past the loop's last tile, none), so one compare per tile masks them.

    Only entries of blocks with a key of the tile below piece position ``positions_end`` are
    read: padding past the sequence is never touched.
    """
    if KV_PATH == "two_blocks":
        first = n_start // BLOCK_SIZE
        id0 = tl.load(table_row + first * stride_table_col, mask=n_start < positions_end, other=0)
        edge = (first + 1) * BLOCK_SIZE
        second_needed = (edge < n_start + BLOCK_N) & (edge < positions_end)
        id1 = tl.load(table_row + (first + 1) * stride_table_col, mask=second_needed, other=0)
        return id0, id1, tl.zeros([BLOCK_N], dtype=tl.int32)
    elif PIECE_SIZE % BLOCK_N == 0:
        # The tile lies inside one block: one entry.
        block = n_start // PIECE_SIZE
        id0 = tl.load(table_row + block * stride_table_col, mask=n_start < positions_end, other=0)
        return id0, 0, tl.zeros([BLOCK_N], dtype=tl.int32)
    elif BLOCK_N % PIECE_SIZE == 0 and (BLOCK_SIZE < BLOCK_N or not MASKED):
        # Whole pieces per tile: load each entry once and repeat it over its piece's rows. (The
        # masked tiles of a block larger than the tile read an entry per row instead: they are
        # rare, and the repeated entries' registers, live across the other loops, made FP8-MMA
        # spill at block 520, whose remainder runs masked only.)
        NUM_BLOCKS: tl.constexpr = BLOCK_N // PIECE_SIZE
        # A scalar first entry and loop-invariant offsets from it: per entry, one add.
        first = n_start // PIECE_SIZE
        blocks = tl.arange(0, NUM_BLOCKS)
        entries = (table_row + first * stride_table_col) + blocks * stride_table_col
        if WHOLE_TILE:
            # One compare per tile instead of one per entry (``blocks * 0`` makes it a vector
            # the interpreter takes as a mask; the compiler folds it away).
            needed = blocks * 0 + n_start + BLOCK_N <= positions_end
        else:
            needed = blocks < tl.cdiv(positions_end, PIECE_SIZE) - first
        per_block = tl.load(entries, mask=needed, other=0)
        ids = tl.reshape(tl.broadcast_to(per_block[:, None], (NUM_BLOCKS, PIECE_SIZE)), (BLOCK_N,))
        return 0, 0, ids
    else:
        pos = n_start + tl.arange(0, BLOCK_N)
        entries = table_row + (pos // PIECE_SIZE) * stride_table_col
        return 0, 0, tl.load(entries, mask=pos < positions_end, other=0)


@triton.jit
def _fp8_mma_key_order(offs):
    """The tile position whose key feeds column ``offs`` of the scores when ``P V`` is an FP8
    MMA with P taken from registers (``_fp8_operand``): within each run of 16 columns ``8j + 2q
    + b`` (thread ``q`` of a quad holds columns ``2q, 2q + 1, 2q + 8, 2q + 9``), position ``4q +
    2j + b``.

    The score MMA's accumulator gives each thread of a quad two adjacent columns of every 8,
    the 8-bit MMA's A operand four adjacent keys of every 16. Loading K's rows (and reading the
    scales) in this order makes the keys a thread holds in the scores the keys its A operand
    covers, so the probabilities feed the MMA as they lie in registers, against V's tile in
    plain position order: no shuffle. (Reordering V's keys instead would not do: its tiles come
    by descriptor or 16-byte copies, which keep a run of 16 keys as it lies, and a pool stored
    so would be no strided view.)"""
    return (offs & ~15) | (((offs >> 1) & 3) << 2) | (((offs >> 3) & 1) << 1) | (offs & 1)


@triton.jit
def _in_fp8_mma_key_order(x, BLOCK_N: tl.constexpr):
    """A tile's vector ``x`` by position, reordered by score column: element ``c`` is
    ``x[_fp8_mma_key_order(c)]`` (a relabelling, as ``_fp8_operand``'s inverse)."""
    runs = tl.reshape(x, (BLOCK_N // 16, 4, 2, 2))
    return tl.reshape(tl.permute(runs, (0, 2, 1, 3)), (BLOCK_N,))


@triton.jit
def _fp8_operand(p, BLOCK_N: tl.constexpr):
    """Probabilities ``p`` (rows of ``BLOCK_N`` score columns, K's rows loaded in
    ``_fp8_mma_key_order``) as the A operand of ``P V`` over V's tile in position order: column
    ``4q + 2j + b`` of each run of 16 is score column ``8j + 2q + b``. A relabelling of the
    registers each thread holds (Triton emits no instruction for it); without it the
    conversion to the operand's layout took 48 shuffles, selects and byte permutes a thread
    per 128 x 128 tile."""
    rows: tl.constexpr = p.shape[0]
    runs = tl.reshape(p, (rows, BLOCK_N // 16, 2, 4, 2))
    return tl.reshape(tl.permute(runs, (0, 1, 3, 2, 4)), (rows, BLOCK_N))


@triton.jit
def _tile_base(
    id0,
    n_start,
    cache,
    OFFSETS_32: tl.constexpr,
    PIECE_OFFSET: tl.constexpr,
    PIECE_SIZE: tl.constexpr,
    KEYS_ALIGNED: tl.constexpr,
):
    """The element offset of a tile's first key row from the cache's head pointer, for a tile
    inside one block (``_tile_rows``' arguments)."""
    offset_type = tl.int32 if OFFSETS_32 else tl.int64
    first_slot = PIECE_OFFSET + n_start % PIECE_SIZE
    base = id0.to(offset_type) * cache[1] + first_slot.to(offset_type) * cache[2]
    if KEYS_ALIGNED and PIECE_OFFSET % 16 == 0:
        # Tiles start at multiples of BLOCK_N (>= 16) piece positions.
        base = tl.multiple_of(base, 16)
    return base


@triton.jit
def _tile_rows(
    id0,
    id1,
    ids,
    n_start,
    cache,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_PATH: tl.constexpr,
    OFFSETS_32: tl.constexpr,
    PIECE_OFFSET: tl.constexpr,
    PIECE_SIZE: tl.constexpr,
    KEYS_ALIGNED: tl.constexpr,
    MMA_ORDER: tl.constexpr,
):
    """Element offsets of the tile's key rows in one cache (from its head pointer), from its
    block ids: int32 when every offset into the pool fits (``OFFSETS_32``, checked by the
    launcher: the head pointer is then the one 64-bit address, as in a plain flash loop), else
    int64.

    ``cache`` is ``(head pointer, block stride, slot stride, ...)``. Tiles start at multiples of
    ``BLOCK_N`` piece positions; the per-row parts are loop-invariant where they can be, so a
    tile costs a scalar base plus, for ``two_blocks``, one select per row.

    ``KEYS_ALIGNED``: the pool is keys-major with every (block, head[, channel]) row of keys
    starting 16-element aligned (the launcher checked it, ``kernels.pool_layout``). Triton is
    then told that each run of 16 keys starting at a multiple of 16 is contiguous and aligned:
    its alignment analysis loses that through the key loop, and Triton 3.6 then read a
    keys-major V tile a byte at a time, synchronously, instead of prefetching it 16 bytes at a
    time (and copied a keys-major scale tile one scale at a time instead of two).

    ``MMA_ORDER``: row ``c`` is the key at position ``_fp8_mma_key_order(c)`` (a permutation
    within each run of 16 positions; ``ids`` are by position).
    """
    offset_type = tl.int32 if OFFSETS_32 else tl.int64
    stride_block = cache[1]
    stride_slot = cache[2]
    offs_n = tl.arange(0, BLOCK_N)
    if MMA_ORDER:
        offs_n = _fp8_mma_key_order(offs_n)
    if KV_PATH == "two_blocks":
        first_slot = n_start % BLOCK_SIZE
        base = id0.to(offset_type) * stride_block + first_slot.to(offset_type) * stride_slot
        rows = base + offs_n.to(offset_type) * stride_slot
        # Rows past the block's end move from block id0 slot BLOCK_SIZE + i to block id1
        # slot i.
        jump = (id1 - id0).to(offset_type) * stride_block - BLOCK_SIZE * stride_slot
        # (A select here hides the rows' alignment from the pipeliner; a product does not.)
        rows += (offs_n >= BLOCK_SIZE - first_slot).to(offset_type) * jump
    elif PIECE_SIZE % BLOCK_N == 0:
        base = _tile_base(id0, n_start, cache, OFFSETS_32, PIECE_OFFSET, PIECE_SIZE, KEYS_ALIGNED)
        rows = base + offs_n.to(offset_type) * stride_slot
    else:
        if MMA_ORDER and PIECE_SIZE % 16 != 0:
            # Pieces under 16 keys: a run of 16 positions spans several blocks.
            ids = _in_fp8_mma_key_order(ids, BLOCK_N)
        # When the piece divides the tile, every tile's slots are the same (loop-invariant).
        shift = 0 if BLOCK_N % PIECE_SIZE == 0 else n_start
        slot = PIECE_OFFSET + (shift + offs_n) % PIECE_SIZE
        rows = ids.to(offset_type) * stride_block + slot.to(offset_type) * stride_slot
        # Each piece's keys in the tile are runs of RUN keys starting at multiples of RUN (the
        # largest power of two dividing the piece, 16 at most: one 16-byte copy of codes).
        RUN: tl.constexpr = min(16, PIECE_SIZE & -PIECE_SIZE)
        ALIGNED_RUNS: tl.constexpr = KEYS_ALIGNED and not MMA_ORDER and RUN >= 4
        if ALIGNED_RUNS and PIECE_OFFSET % RUN == 0 and BLOCK_N % PIECE_SIZE == 0:
            rows = tl.max_contiguous(tl.multiple_of(rows, RUN), RUN)
    return rows


@triton.jit
def _tile_rows_pair(
    id0,
    id1,
    ids,
    n_start,
    first,
    second,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_PATH: tl.constexpr,
    OFFSETS_32: tl.constexpr,
    PIECE_OFFSET: tl.constexpr,
    PIECE_SIZE: tl.constexpr,
    FIRST_KEYS_ALIGNED: tl.constexpr,
    SECOND_KEYS_ALIGNED: tl.constexpr,
    FIRST_MMA_ORDER: tl.constexpr,
    SHARED: tl.constexpr,
):
    """``_tile_rows`` of two caches read alike (K and V, or their scale pools), the first's
    rows in ``MMA_ORDER`` if asked (the second's stay in position order); ``SHARED``: the two
    have equal strides, so the second's rows are the first's where both are in one order."""
    first_rows = _tile_rows(
        id0, id1, ids, n_start, first, BLOCK_N, BLOCK_SIZE, KV_PATH, OFFSETS_32, PIECE_OFFSET,
        PIECE_SIZE, FIRST_KEYS_ALIGNED, FIRST_MMA_ORDER,
    )  # fmt: skip
    if SHARED and not FIRST_MMA_ORDER:
        second_rows = first_rows
    else:
        second_rows = _tile_rows(
            id0, id1, ids, n_start, second, BLOCK_N, BLOCK_SIZE, KV_PATH, OFFSETS_32,
            PIECE_OFFSET, PIECE_SIZE, SECOND_KEYS_ALIGNED, False,
        )  # fmt: skip
    return first_rows, second_rows


@triton.jit
def _load_scales(
    scales, rows, n_mask, MASKED: tl.constexpr, WIDE: tl.constexpr, BLOCK_N: tl.constexpr
):
    """The key tile's scales (float32, one per row): ``scales + rows``, hidden rows 0.

    Unmasked, a plain load by default (64-key tiles load K's and V's together instead,
    ``_load_scale_pair``): Triton prefetches it with the K/V tiles (``cp.async``) and reads it
    from shared memory in the score MMA's column layout, so the scales add no barrier (per
    iteration at block 64: Triton 3.9, 4 barriers against 6-10 wide, bf16 3; Triton 3.6, 2
    against 10-12 wide, bf16 2). Triton 3.6 pays for a plain load in copies: each thread copies
    its own columns' scales, where 3.9 copies each scale once. ``WIDE`` (a launch option, so
    that a GPU run can time both) reads them the masked way below.

    Masked (and ``WIDE``), they are read as ``BLOCK_N x SPREAD`` equal values (at least 256, a
    thread each at 8 warps) and reduced: a load this wide keeps its own layout, and the scales
    move to the MMA's through shared memory once (behind barriers). A masked load of fewer
    elements than threads is recomputed in the layout its consumer wants, where each thread
    holds a quarter of the tile's columns: the address arithmetic and the mask (on the ``rows``
    path every block id read, division and modulo) then ran once per column per thread (blocks
    16 and 24, dequantizing: about 240 more instructions per masked iteration, and spills).
    """
    if MASKED or WIDE:
        SPREAD: tl.constexpr = 256 // BLOCK_N if BLOCK_N < 256 else 1
        wide = scales + rows[:, None] + tl.zeros([1, SPREAD], dtype=rows.dtype)
        wide = tl.load(wide, mask=n_mask[:, None], other=0.0) if MASKED else tl.load(wide)
        column = tl.max(wide, axis=1)
    else:
        column = tl.load(scales + rows)
    return column


@triton.jit
def _load_scale_pair(k_scales, ks_rows, v_scales, vs_rows):
    """An unmasked 64-key tile's K and V scales (float32, one per row each) as one load of (K,
    V) pairs: ``(k_scales + ks_rows, v_scales + vs_rows)``.

    Triton (3.6) moves a load of fewer elements than threads into the layout of its use (such
    a load is presumed cheap): a scale column then took the score MMA's column layout, where
    each thread copied its own 16 columns, 4 bytes at a time (32 ``cp.async`` and their 64-bit
    addresses a tile for K and V, 60-160 instructions). A load of 256 elements (a thread each
    at 8 warps) keeps a layout of its own: each scale is copied once and read from shared
    memory in the MMA's layout, four at a time (two keys' pairs). The 128 pairs are loaded
    twice over to reach 256 (the second copy is never read). At 128-key tiles the pairs alone
    would do, but the pointer loop then spilled on Triton 3.6 (32-36 bytes), so those tiles
    keep one load per column (``_load_scales``).
    """
    which = tl.arange(0, 2)
    # (copy, key, K or V): the copy slowest in shared memory, so that a thread's two adjacent
    # keys' pairs are contiguous there.
    copies = tl.zeros([2, 1, 1], dtype=ks_rows.dtype)
    pairs = tl.where(
        (which == 0)[None, None, :],
        k_scales + ks_rows[None, :, None] + copies,
        v_scales + vs_rows[None, :, None] + copies,
    )
    first, _ = tl.split(tl.permute(tl.load(pairs), (1, 2, 0)))
    k_col, v_col = tl.split(first)
    return k_col, v_col


@triton.jit
def _program_rows(tile_m, kv_head, q_len, BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
    """``(query, head, mask)`` of the query tile's rows: row r of tile ``tile_m`` is query ``r //
    GROUP`` of the sequence, query head ``kv_head * GROUP + r % GROUP``; rows past ``q_len``
    queries are masked."""
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    query = offs_m // GROUP
    return query, kv_head * GROUP + offs_m % GROUP, query < q_len


@triton.jit
def _tile_index_again(INTERPRETED: tl.constexpr):
    """``tl.program_id(0)``, read again from ``%ctaid.x`` by a PTX move with side effects, so
    that the compiler neither reuses an earlier read nor what was computed from one.

    The output's row offsets are the query load's (tile row, head): reused after the key loops,
    they stayed live across them and, at 255 registers, ptxas spilled them rather than redo
    one ``or`` each (FP8-MMA: 16-68 bytes a launch on Triton 3.9, 20 on 3.6).
    """
    if INTERPRETED:  # the interpreter runs no PTX
        return tl.program_id(0)
    # The argument is a constant: the move reads nothing that must stay live.
    return tl.inline_asm_elementwise(
        "mov.u32 $0, %ctaid.x;", "=r,r", [tl.full([], 0, tl.int32)], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _unknown_again(x, INTERPRETED: tl.constexpr):
    """``x`` through a PTX move with side effects: the compiler recomputes what it derives
    from the result instead of keeping what it derived from ``x`` live until then."""
    if INTERPRETED:
        return x
    return tl.inline_asm_elementwise(
        "mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _float16_rows(q):
    """``(codes, factor)``: bfloat16 (or float32) rows ``q`` times a power of two each, as
    float16, and the factor (divide the softmax scale by it).

    int8 K codes then convert to the ``Q K^T`` MMA's operand in 1.25 instructions per code
    (``int8_to_float16``; to bfloat16, 2). Each row's
    largest magnitude lands in ``[2**13, 2**14)``: no overflow (float16 holds 65504), and every
    element within ``2**-27`` of it keeps all 8 significant bits of a bfloat16 (float16 normals
    have 11), so its products with the codes stay exact (int8 codes have 7 significant bits).
    """
    amax = tl.max(tl.abs(q.to(tl.float32)), axis=1)
    exponent = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    # 2**(13 - floor(log2 amax)) = 2**(140 - exponent), as float32 bits; at most 2**127, the
    # largest power of two the field holds (rows under 2**-114, zero rows among them).
    factor = (tl.minimum(267 - exponent, 254) << 23).to(tl.float32, bitcast=True)
    return (q.to(tl.float32) * factor[:, None]).to(tl.float16), factor


@triton.jit
def _codes_to(codes, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """int8 ``codes`` converted (exactly) to ``dtype``; to float16 by
    ``int8_to_float16`` (1.25 instructions a code, against 2 for Triton's conversion to
    bfloat16)."""
    if codes.dtype == tl.int8 and dtype == tl.float16:
        return int8_to_float16(codes, INTERPRETED)
    return codes.to(dtype)


@triton.jit
def _values_in_unit(
    codes, scales, p_unit, dtype: tl.constexpr, MASKED: tl.constexpr, INTERPRETED: tl.constexpr
):
    """V's ``codes`` (rows of keys) converted exactly to ``dtype``; unmasked, times their keys'
    ``scales`` in units of ``p_unit``, two elements per multiply in float16 (masked tiles scale
    their probabilities instead: their scales arrive in the probabilities' layout)."""
    values = _codes_to(codes, dtype, INTERPRETED)
    if not MASKED:
        values = values * (scales * (1.0 / p_unit)).to(dtype)[:, None]
    return values


@triton.jit
def _attend_tiles(
    state,
    q,
    caches,
    descs,
    table,
    first_tile,
    head_tiles,
    tiles_start,
    num_tiles,
    keys_lo,
    keys_hi,
    positions_end,
    key_limit,
    scale_log2,
    p_unit,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_PATH: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    OFFSETS_32: tl.constexpr,
    MASKED: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,
    V_KEYS_MAJOR: tl.constexpr,
    SCALES_KEYS_MAJOR: tl.constexpr,
    WIDE_SCALES: tl.constexpr,
    K8V8: tl.constexpr,
    V_BLOCK_SCALES: tl.constexpr,
    K8V16: tl.constexpr,
    PV_DTYPE: tl.constexpr,
    INTERPRETED: tl.constexpr,
    TMA: tl.constexpr,
    SCORE_BITS: tl.constexpr,
    PIECE_OFFSET: tl.constexpr,
    PIECE_SIZE: tl.constexpr,
    MOST_HEAD_TILES: tl.constexpr,
):
    """Online softmax over ``num_tiles`` key tiles: tile 0 starts at ``first_tile``, tile j > 0
    at ``tiles_start + (j - 1) * BLOCK_N``; or, masked with ``MOST_HEAD_TILES`` > 1, tile j at
    ``first_tile + j * BLOCK_N`` for j < ``head_tiles`` and at ``tiles_start + (j - head_tiles)
    * BLOCK_N`` after (``head_tiles`` is ignored otherwise). The one tile body of both loops:
    ``MASKED`` adds the masks (a compile-time flag, so the unmasked loop carries none of them).

    ``state`` is ``(acc, row_max, row_sum)``, returned updated; ``caches`` the K and
    V pools of the KV head (then, ``QUANTIZED``, its K and V scale pools) as ``(head pointer,
    block stride, slot stride[, dim stride])``; ``descs`` (``TMA``) the K and V descriptors, the
    KV head's first column in them (a keys-major V's first row in a block) and the columns of
    all KV heads (a keys-major V's rows per block), then (quantized) the K and V scale
    descriptors and the KV head's offsets in them; ``table`` the sequence's ``(block table
    row, column stride)``.

    ``MASKED``: only keys in ``[keys_lo, keys_hi)`` are loaded and a row sees keys below its
    ``key_limit``. Tile starts are positions in the blocks' piece ``[PIECE_OFFSET, PIECE_OFFSET +
    PIECE_SIZE)`` (``_attend_run``; the keys themselves when the piece is the whole block), key
    bounds are keys; ``positions_end`` is ``keys_hi``'s piece position (no table entry at or
    past it is read). Unmasked: every row sees every key of every tile. ``scale_log2`` is a
    scalar, or per row on quantized caches (the query rows' scales or factors folded in); it
    must be >= 0.

    ``QUANTIZED``: K/V tiles are codes with a scale per key row (loaded like the tile's rows, from
    the scale pools). The K scales multiply the score columns, the V scales V's rows or the
    probability columns (row sums from the unscaled probabilities), in units of ``p_unit``
    (acc then holds the output in that unit; ``value_units``). The codes convert exactly, K's
    to q's compute dtype, V's to ``PV_DTYPE`` (float16 on a GPU); unmasked tiles scale V's
    rows, masked ones the probabilities, and ``p_unit`` is the sequence's largest V scale * 448
    / 2**15 (no scaled V element exceeds 2**15).
    """
    acc, row_max, row_sum = state
    k_cache = caches[0]
    v_cache = caches[1]
    if QUANTIZED:
        k_scales = caches[2]
        v_scales = caches[3]
    if K8V8:
        ones = _sums_operand(BLOCK_N)
    table_row, stride_table_col = table
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # The 8-bit MMA reads V with its reduction axis (keys) contiguous in shared memory. A
    # keys-major V pool (``V_KEYS_MAJOR``) is laid out so: its e4m3 tile is prefetched into
    # shared memory and feeds the MMA as loaded. A slot-major one is read as bytes, prefetched
    # like K, and transposed through shared memory every tile (Triton does not prefetch an e4m3
    # load that needs the transpose: it read V synchronously in the loop).
    v_head = v_cache[0].to(tl.pointer_type(tl.uint8)) if K8V8 and not V_KEYS_MAJOR else v_cache[0]
    k_dims = k_cache[0] + offs_d[None, :] * k_cache[3]
    v_dims = v_head + offs_d[None, :] * v_cache[3]
    d_mask = offs_d[None, :] < HEAD_DIM
    # Quantized caches take the softmax scale per row (the query rows' scales folded in).
    row_scale = scale_log2[:, None] if QUANTIZED else scale_log2
    # Tiles inside one block: one scalar base per tile.
    SCALAR_BASE: tl.constexpr = KV_PATH != "two_blocks" and PIECE_SIZE % BLOCK_N == 0
    # TMA: whole tiles inside one block are descriptor loads (masked tiles load only the keys
    # they show, so they stay pointer loads).
    DESCRIPTOR_LOADS: tl.constexpr = TMA and not MASKED and SCALAR_BASE
    # k8v8's unmasked loops read K's rows and the scales in the order that lets the
    # probabilities feed P V from registers (``_fp8_mma_key_order``); masked tiles keep
    # position order, in which their masks are.
    MMA_ORDER: tl.constexpr = K8V8 and not MASKED
    # Their unmasked pointer loads: loop-invariant pointer tiles plus the tile's scalar base,
    # one wide multiply-add per address as in a plain loop (pointers plus per-row offsets took
    # an add and a 64-bit add per address, 3 instructions).
    if SCALAR_BASE:
        k_offs = _fp8_mma_key_order(offs_n) if MMA_ORDER else offs_n
        k_tile = k_cache[0] + (k_offs[:, None] * k_cache[2] + offs_d[None, :] * k_cache[3])
        v_tile = v_head + (offs_n[:, None] * v_cache[2] + offs_d[None, :] * v_cache[3])
    # Per-row offsets only where a load takes them: K/V's in masked tiles and tiles across
    # blocks (a scalar base or a descriptor otherwise), the scales' but by descriptor.
    KV_ROWS: tl.constexpr = MASKED or not SCALAR_BASE
    SCALE_ROWS: tl.constexpr = QUANTIZED and not DESCRIPTOR_LOADS
    # With equal K/V strides the V (scale) rows are the K (scale) rows (a scalar base is
    # cheaper computed twice).
    SHARE_ROWS: tl.constexpr = SAME_KV_STRIDES and not SCALAR_BASE
    # The unmasked 16-bit loops mask a tile's entries with one compare (1-2.5% shorter at
    # blocks 16, 24, 31; in the quantized loops it moved -1% to +1% and made an FP8 MMA loop
    # keep a value in local memory across the pieces' loops at block 31).
    WHOLE_TILE_ENTRIES: tl.constexpr = not MASKED and not QUANTIZED
    # Two head tiles (masked tiles half the unmasked one): tiles from two bases.
    HEAD_PAIR: tl.constexpr = MASKED and MOST_HEAD_TILES > 1
    if HEAD_PAIR:
        start = tl.where(head_tiles > 0, first_tile, tiles_start)
        tail_base = tiles_start - head_tiles * BLOCK_N  # tile j of the tail's start - j * BLOCK_N
    else:
        start = first_tile
    id0, id1, ids = _tile_block_ids(
        table_row,
        stride_table_col,
        start,
        positions_end,
        BLOCK_N,
        BLOCK_SIZE,
        KV_PATH,
        PIECE_OFFSET,
        PIECE_SIZE,
        MASKED,
        WHOLE_TILE_ENTRIES,
    )
    for j in range(0, num_tiles):
        if HEAD_PAIR:
            n_start = tl.where(j < head_tiles, first_tile, tail_base) + j * BLOCK_N
            next_base = tl.where(j + 1 < head_tiles, first_tile, tail_base)
            next_start = next_base + (j + 1) * BLOCK_N
        elif MASKED:
            n_start = tl.where(j == 0, first_tile, tiles_start + (j - 1) * BLOCK_N)
            next_start = tiles_start + j * BLOCK_N
        else:
            n_start = first_tile + j * BLOCK_N
            next_start = tiles_start + j * BLOCK_N
        # The next tile's block ids first: its K/V addresses are known a whole iteration early.
        next_id0, next_id1, next_ids = _tile_block_ids(
            table_row,
            stride_table_col,
            next_start,
            positions_end,
            BLOCK_N,
            BLOCK_SIZE,
            KV_PATH,
            PIECE_OFFSET,
            PIECE_SIZE,
            MASKED,
            WHOLE_TILE_ENTRIES,
        )
        if KV_ROWS:
            k_rows, v_rows = _tile_rows_pair(
                id0, id1, ids, n_start, k_cache, v_cache, BLOCK_N, BLOCK_SIZE, KV_PATH,
                OFFSETS_32, PIECE_OFFSET, PIECE_SIZE, False, V_KEYS_MAJOR, MMA_ORDER, SHARE_ROWS,
            )  # fmt: skip
        if SCALE_ROWS:
            # (k8v8 has no V scale per key: its second rows are K's again, never read.)
            ks_rows, vs_rows = _tile_rows_pair(
                id0, id1, ids, n_start, k_scales, k_scales if K8V8 or K8V16 else v_scales, BLOCK_N,
                BLOCK_SIZE, KV_PATH,
                OFFSETS_32, PIECE_OFFSET, PIECE_SIZE, SCALES_KEYS_MAJOR, SCALES_KEYS_MAJOR,
                False, SHARE_ROWS,
            )  # fmt: skip
        if MASKED:
            if PIECE_SIZE == BLOCK_SIZE:
                keys = n_start + offs_n
            else:
                pos = n_start + offs_n
                keys = pos // PIECE_SIZE * BLOCK_SIZE + PIECE_OFFSET + pos % PIECE_SIZE
            n_mask = (keys >= keys_lo) & (keys < keys_hi)
            # Hidden keys are never loaded: they may be unwritten slots holding NaN.
            k = tl.load(k_dims + k_rows[:, None], mask=n_mask[:, None] & d_mask, other=0.0)
            v = tl.load(v_dims + v_rows[:, None], mask=n_mask[:, None] & d_mask, other=0.0)
            if QUANTIZED:
                k_col = _load_scales(k_scales[0], ks_rows, n_mask, True, False, BLOCK_N)
                if not (K8V8 or K8V16):
                    v_col = _load_scales(v_scales[0], vs_rows, n_mask, True, False, BLOCK_N)
        else:
            if DESCRIPTOR_LOADS:
                # (k8v8's descriptor tiles, K in the 8-bit MMA's key order and V keys-major,
                # run in _attend_k8v8_ahead.)
                slot = PIECE_OFFSET + n_start % PIECE_SIZE
                k = descs[0].load([id0 * BLOCK_SIZE + slot, descs[2]])
                v = descs[1].load([id0 * BLOCK_SIZE + slot, descs[2]])
            elif SCALAR_BASE:
                k_base = _tile_base(
                    id0, n_start, k_cache, OFFSETS_32, PIECE_OFFSET, PIECE_SIZE, False
                )
                v_base = _tile_base(
                    id0, n_start, v_cache, OFFSETS_32, PIECE_OFFSET, PIECE_SIZE, V_KEYS_MAJOR
                )
                if HEAD_DIM == BLOCK_D:
                    k = tl.load(k_tile + k_base)
                    v = tl.load(v_tile + v_base)
                else:
                    k = tl.load(k_tile + k_base, mask=d_mask, other=0.0)
                    v = tl.load(v_tile + v_base, mask=d_mask, other=0.0)
            elif HEAD_DIM == BLOCK_D:
                k = tl.load(k_dims + k_rows[:, None])
                v = tl.load(v_dims + v_rows[:, None])
            else:
                k = tl.load(k_dims + k_rows[:, None], mask=d_mask, other=0.0)
                v = tl.load(v_dims + v_rows[:, None], mask=d_mask, other=0.0)
            if QUANTIZED and DESCRIPTOR_LOADS:
                # (V's scales first: in the other order Triton 3.9's FP8 MMA loop kept 4 values
                # in local memory across it, 12-16 bytes at blocks 256, 520, 1560; the other
                # modes' loops are as long this way, or 2-4 instructions shorter.)
                if not (K8V8 or K8V16):
                    v_col = descs[5].load([id0 * v_scales[1] + descs[7] + slot])
                k_col = descs[4].load([id0 * k_scales[1] + descs[6] + slot])
            elif K8V8 or K8V16:
                k_col = _load_scales(k_scales[0], ks_rows, 0, False, WIDE_SCALES, BLOCK_N)
            elif QUANTIZED and not WIDE_SCALES and BLOCK_N == 64:
                k_col, v_col = _load_scale_pair(k_scales[0], ks_rows, v_scales[0], vs_rows)
            elif QUANTIZED:
                k_col = _load_scales(k_scales[0], ks_rows, 0, False, WIDE_SCALES, BLOCK_N)
                v_col = _load_scales(v_scales[0], vs_rows, 0, False, WIDE_SCALES, BLOCK_N)
            if QUANTIZED and MMA_ORDER:
                # The scales come in position order (each copied in runs of 16 bytes) and are
                # read from shared memory in K's: four contiguous ones a thread. (Loaded in K's
                # order they were copied 8 or 4 bytes at a time: head_dim 256, 32-key tiles,
                # Triton 3.6: 393 instructions a tile against 339.)
                k_col = _in_fp8_mma_key_order(k_col, BLOCK_N)
        if K8V8 or K8V16:
            qk = _scores_in_float(tl.dot(q, tl.trans(k)), SCORE_BITS, INTERPRETED)
            if K8V16 and UPCAST:
                v = v.to(tl.float32)
        else:
            if QUANTIZED:
                # Codes are exact in every compute dtype (int8: 7 significant bits);
                # K's in q's (float16 for a bfloat16 q: see _float16_rows), V's in P V's.
                k = _codes_to(k, q.dtype, INTERPRETED)
                v = _values_in_unit(v, v_col, p_unit, PV_DTYPE, MASKED, INTERPRETED)
            elif UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if QUANTIZED:
            # (The dequantizing modes' scores are of a 16-bit MMA: never biased.)
            qk = _k_scaled(qk, k_col, SCORE_BITS and (K8V8 or K8V16))
        if MASKED:
            visible = n_mask[None, :] & (keys[None, :] < key_limit[:, None])
            scores = tl.where(visible, qk * row_scale, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, axis=1))
            # A row that has seen no visible key yet keeps max -inf; subtract 0 instead of
            # -inf so exp2 gives 0, not NaN.
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            if K8V8:
                probs = tl.math.exp2(scores - (safe_max - LOG2_E4M3_MAX)[:, None])
            else:
                probs = tl.math.exp2(scores - safe_max[:, None])
            rescale = tl.math.exp2(row_max - safe_max)
        else:
            # scale_log2 >= 0 (the launcher makes it so): max(qk) * scale is the scaled max,
            # and qk * scale - max is one FFMA per score.
            new_max = tl.maximum(row_max, tl.max(qk, axis=1) * scale_log2)
            if K8V8:
                probs = tl.math.exp2(qk * row_scale - (new_max - LOG2_E4M3_MAX)[:, None])
            else:
                probs = tl.math.exp2(qk * row_scale - new_max[:, None])
            rescale = tl.math.exp2(row_max - new_max)
        if K8V8:
            # The probabilities are biased by log2(448) (in the row's subtrahend: no
            # instruction more), so the row's largest is 448, e4m3's largest: rounded to e4m3
            # as they are, they feed P V with no multiply, and their row sums come from an FP8
            # MMA over a column of ones (no add per probability). V's codes are of its channel
            # scales: a frozen one multiplies the output once (the epilogue), a block's this
            # tile's MMA sum as it is added into acc (the tile lies inside the block), one FFMA
            # per element as bf16's acc * rescale + pv.
            p_codes = to_e4m3(probs, INTERPRETED)
            if MMA_ORDER:
                p_codes = _fp8_operand(p_codes, BLOCK_N)
            if not V_KEYS_MAJOR:
                v = v.to(tl.float8e4nv, bitcast=True)
            row_sum = _add_row_sums(row_sum, rescale, p_codes, ones)
            pv = tl.dot(p_codes, v)
            if V_BLOCK_SCALES:
                v_channels = _v_block_channels(v_scales, id0, HEAD_DIM, BLOCK_D)
            else:
                v_channels = 1.0
            acc = _k8v8_flush(acc, pv, rescale, v_channels, V_BLOCK_SCALES)
        else:
            # (The row sums of the probabilities before any V scale multiplies them.)
            row_sum = row_sum * rescale + tl.sum(probs, axis=1)
            if QUANTIZED and MASKED and not K8V16:
                probs = probs * (v_col * (1.0 / p_unit))[None, :]
            pv = tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
            acc = acc * rescale[:, None] + pv
        row_max = new_max
        id0, id1, ids = next_id0, next_id1, next_ids
    return acc, row_max, row_sum


@triton.jit
def _unmasked_tile(
    cache,
    desc,
    desc_col,
    tile,
    id0,
    id1,
    ids,
    n_start,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_PATH: tl.constexpr,
    OFFSETS_32: tl.constexpr,
    PIECE_OFFSET: tl.constexpr,
    PIECE_SIZE: tl.constexpr,
    DESCRIPTOR_LOADS: tl.constexpr,
    SCALAR_BASE: tl.constexpr,
    KEYS_ALIGNED: tl.constexpr = False,
    MMA_ORDER: tl.constexpr = False,
):
    """One cache's whole key tile at piece position ``n_start`` from its block ids (as
    ``_attend_tiles`` loads an unmasked tile): by descriptor (``desc`` at column ``desc_col``),
    from the loop-invariant pointer tile ``tile`` plus a scalar base, or by per-row offsets
    (``tile`` then points at the head's channels; ``_key_tile_pointers`` makes either).
    ``KEYS_ALIGNED``, ``MMA_ORDER``: as ``_tile_rows``' (a scalar base's tile has its rows'
    order built in)."""
    if DESCRIPTOR_LOADS:
        return desc.load([id0 * BLOCK_SIZE + PIECE_OFFSET + n_start % PIECE_SIZE, desc_col])
    if SCALAR_BASE:
        ptrs = tile + _tile_base(
            id0, n_start, cache, OFFSETS_32, PIECE_OFFSET, PIECE_SIZE, KEYS_ALIGNED
        )
    else:
        rows = _tile_rows(
            id0, id1, ids, n_start, cache, BLOCK_N, BLOCK_SIZE, KV_PATH, OFFSETS_32,
            PIECE_OFFSET, PIECE_SIZE, KEYS_ALIGNED, MMA_ORDER,
        )  # fmt: skip
        ptrs = tile + rows[:, None]
    if HEAD_DIM == BLOCK_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=tl.arange(0, BLOCK_D)[None, :] < HEAD_DIM, other=0.0)


@triton.jit
def _key_tile_pointers(
    k_head, k_cache, v_head, v_cache, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SCALAR_BASE: tl.constexpr, MMA_ORDER: tl.constexpr,
):  # fmt: skip
    """K's and V's loop-invariant pointer tiles for ``_unmasked_tile`` (from the head pointers
    ``k_head``, ``v_head`` and the caches' strides): a tile's rows and channels for a scalar
    base, K's rows in the 8-bit MMA's key order (``MMA_ORDER``), V's in position order; else
    the head's channels, for per-row offsets."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if SCALAR_BASE:
        k_offs = _fp8_mma_key_order(offs_n) if MMA_ORDER else offs_n
        k_tile = k_head + (k_offs[:, None] * k_cache[2] + offs_d[None, :] * k_cache[3])
        v_tile = v_head + (offs_n[:, None] * v_cache[2] + offs_d[None, :] * v_cache[3])
    else:
        k_tile = k_head + offs_d[None, :] * k_cache[3]
        v_tile = v_head + offs_d[None, :] * v_cache[3]
    return k_tile, v_tile


@triton.jit
def _attend_tiles_ahead(
    state,
    q,
    caches,
    descs,
    table,
    first_tile,
    num_tiles,
    positions_end,
    scale_log2,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_PATH: tl.constexpr,
    OFFSETS_32: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    PIECE_OFFSET: tl.constexpr,
    PIECE_SIZE: tl.constexpr,
):
    """``_attend_tiles``' unmasked loop over 16-bit caches (tile j at ``first_tile + j *
    BLOCK_N``) with the scores one tile ahead: iteration j issues tile j + 1's ``Q K^T`` MMA
    before tile j's softmax, so the tensor cores run it while the softmax's instructions issue
    (FlashAttention-3's overlap within a warpgroup; in the plain loop every softmax waits for
    its own scores, and the tensor cores idle through it). Triton still waits for that MMA
    right after issuing it; ptxas moves the softmax's instructions, which do not depend on it,
    above the wait. It holds a second tile of scores in registers (docs/kernels.md)."""
    k_cache = caches[0]
    v_cache = caches[1]
    table_row, stride_table_col = table
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    SCALAR_BASE: tl.constexpr = KV_PATH != "two_blocks" and PIECE_SIZE % BLOCK_N == 0
    DESCRIPTOR_LOADS: tl.constexpr = TMA and SCALAR_BASE
    if SCALAR_BASE:
        k_tile = k_cache[0] + (offs_n[:, None] * k_cache[2] + offs_d[None, :] * k_cache[3])
        v_tile = v_cache[0] + (offs_n[:, None] * v_cache[2] + offs_d[None, :] * v_cache[3])
    else:
        k_tile = k_cache[0] + offs_d[None, :] * k_cache[3]
        v_tile = v_cache[0] + offs_d[None, :] * v_cache[3]
    # Iteration j reads K of tile min(j, last) and V of tile max(j - 1, 0), so every load is in
    # the loop: Triton gives a load before or after it a shared-memory buffer of its own, and
    # at 128-key tiles those two left room for 2 K/V buffers instead of 3. Iteration 0 takes
    # no softmax step and the last one's scores (tile last again) are dropped: num_tiles + 1
    # iterations, one Q K^T MMA and one P V MMA more than the tiles.
    last = num_tiles - 1
    qk = tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32)
    # Each iteration reads the next one's block ids from the table, K's and V's apart (V's are
    # this K's again): ids carried two iterations, or read in the iteration that loads from
    # them, cost Triton's pipeliner a K/V buffer, or the pipeline.
    k_id0, k_id1, k_ids = _tile_block_ids(
        table_row, stride_table_col, first_tile, positions_end, BLOCK_N, BLOCK_SIZE, KV_PATH,
        PIECE_OFFSET, PIECE_SIZE, False, True,
    )  # fmt: skip
    v_id0, v_id1, v_ids = k_id0, k_id1, k_ids
    for j in range(0, num_tiles + (num_tiles > 0)):
        k_start = first_tile + tl.minimum(j, last) * BLOCK_N
        v_start = first_tile + tl.maximum(j - 1, 0) * BLOCK_N
        next_k_id0, next_k_id1, next_k_ids = _tile_block_ids(
            table_row, stride_table_col, first_tile + tl.minimum(j + 1, last) * BLOCK_N,
            positions_end, BLOCK_N, BLOCK_SIZE, KV_PATH, PIECE_OFFSET, PIECE_SIZE, False, True,
        )  # fmt: skip
        next_v_id0, next_v_id1, next_v_ids = _tile_block_ids(
            table_row, stride_table_col, first_tile + j * BLOCK_N, positions_end, BLOCK_N,
            BLOCK_SIZE, KV_PATH, PIECE_OFFSET, PIECE_SIZE, False, True,
        )  # fmt: skip
        k = _unmasked_tile(
            k_cache, descs[0], descs[2], k_tile, k_id0, k_id1, k_ids, k_start, BLOCK_N, BLOCK_D,
            HEAD_DIM, BLOCK_SIZE, KV_PATH, OFFSETS_32, PIECE_OFFSET, PIECE_SIZE,
            DESCRIPTOR_LOADS, SCALAR_BASE,
        )  # fmt: skip
        v = _unmasked_tile(
            v_cache, descs[1], descs[2], v_tile, v_id0, v_id1, v_ids, v_start, BLOCK_N, BLOCK_D,
            HEAD_DIM, BLOCK_SIZE, KV_PATH, OFFSETS_32, PIECE_OFFSET, PIECE_SIZE,
            DESCRIPTOR_LOADS, SCALAR_BASE,
        )  # fmt: skip
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        next_qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        state = _pv_step(state, qk, v, scale_log2, j == 0, DOT_PRECISION)
        qk = next_qk
        k_id0, k_id1, k_ids = next_k_id0, next_k_id1, next_k_ids
        v_id0, v_id1, v_ids = next_v_id0, next_v_id1, next_v_ids
    return state


@triton.jit
def _k8v8_descriptor_tiles(
    descs,
    k_id0,
    k_slot,
    v_id0,
    v_slot,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    V_KEYS_MAJOR: tl.constexpr,
):
    """A k8v8 tile's K rows (from slot ``k_slot`` of block ``k_id0``, in the 8-bit MMA's key
    order: K's descriptor reads runs of 16 pool rows) and V's (``v_slot`` of ``v_id0``, keys by
    position), one descriptor load each."""
    first_row = k_id0 * BLOCK_SIZE + k_slot
    k = descs[0].load([first_row // 16, 0, 0, first_row % 16, descs[2]])
    if V_KEYS_MAJOR:
        v = tl.trans(descs[1].load([v_id0 * descs[3] + descs[2], v_slot]))
    else:
        v = descs[1].load([v_id0 * BLOCK_SIZE + v_slot, descs[2]])
    return tl.reshape(k, (BLOCK_N, BLOCK_D)), v


@triton.jit
def _attend_k8v8_ahead(
    state,
    q,
    caches,
    descs,
    table,
    first_tile,
    num_tiles,
    positions_end,
    scale_log2,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_PATH: tl.constexpr,
    OFFSETS_32: tl.constexpr,
    V_KEYS_MAJOR: tl.constexpr,
    SCALES_KEYS_MAJOR: tl.constexpr,
    WIDE_SCALES: tl.constexpr,
    V_BLOCK_SCALES: tl.constexpr,
    INTERPRETED: tl.constexpr,
    TMA: tl.constexpr,
    SCORE_BITS: tl.constexpr,
    PIECE_OFFSET: tl.constexpr,
    PIECE_SIZE: tl.constexpr,
):
    """``_attend_tiles``' unmasked loop over k8v8 caches (tile j at ``first_tile + j * BLOCK_N``)
    with the scores one tile ahead, as ``_attend_tiles_ahead``: iteration j issues tile j + 1's
    int8 ``Q K^T`` MMA, then takes tile j's step (``_k8v8_step``: its scores, converted to float
    in the last iteration, times K's scales, the softmax, the FP8 ``P V`` MMA and its flush into
    the float32 acc), so the softmax issues while the score MMA runs. Iteration j reads K's rows
    of tile ``min(j, last)``, V's rows and K's scales of tile ``max(j - 1, 0)``; iteration 0
    takes no step (``num_tiles + 1`` iterations). The flush still waits for its own MMA: a
    ``P V`` sum carried to the next iteration (flushed under the next MMA) needs a third
    accumulator tile of registers beside acc and two tiles of scores (docs/quantization.md)."""
    acc, row_max, row_sum = state
    ones = _sums_operand(BLOCK_N)
    k_cache = caches[0]
    v_cache = caches[1]
    k_scales = caches[2]
    v_scales = caches[3]
    table_row, stride_table_col = table
    SCALAR_BASE: tl.constexpr = KV_PATH != "two_blocks" and PIECE_SIZE % BLOCK_N == 0
    DESCRIPTOR_LOADS: tl.constexpr = TMA and SCALAR_BASE
    # A slot-major V is read as bytes (as _attend_tiles reads it) and transposed in the loop.
    v_head = v_cache[0] if V_KEYS_MAJOR else v_cache[0].to(tl.pointer_type(tl.uint8))
    k_tile, v_tile = _key_tile_pointers(
        k_cache[0], k_cache, v_head, v_cache, BLOCK_N, BLOCK_D, SCALAR_BASE, True
    )
    last = num_tiles - 1
    qk = tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32)
    k_id0, k_id1, k_ids = _tile_block_ids(
        table_row, stride_table_col, first_tile, positions_end, BLOCK_N, BLOCK_SIZE, KV_PATH,
        PIECE_OFFSET, PIECE_SIZE, False, False,
    )  # fmt: skip
    v_id0, v_id1, v_ids = k_id0, k_id1, k_ids
    k_slot = PIECE_OFFSET + first_tile % PIECE_SIZE
    v_slot = k_slot
    for j in range(num_tiles + (num_tiles > 0)):
        k_start = first_tile + tl.minimum(j, last) * BLOCK_N
        v_start = first_tile + BLOCK_N * tl.maximum(j - 1, 0)
        next_k_start = first_tile + tl.minimum(j + 1, last) * BLOCK_N
        next_k_id0, next_k_id1, next_k_ids = _tile_block_ids(
            table_row, stride_table_col, next_k_start, positions_end, BLOCK_N, BLOCK_SIZE,
            KV_PATH, PIECE_OFFSET, PIECE_SIZE, False, False,
        )  # fmt: skip
        # (Beside the block index of the same position: one division for both.)
        next_k_slot = PIECE_OFFSET + next_k_start % PIECE_SIZE
        if SCALAR_BASE:
            # V's next tile is this K's (tile j, or the last): its one id carried.
            next_v_id0, next_v_id1, next_v_ids = k_id0, k_id1, k_ids
        else:
            # A gathered tile's per-row ids read apart for V: carried from K's, block 16's
            # loop spilled on both Tritons (112 and 75 spill stores).
            next_v_id0, next_v_id1, next_v_ids = _tile_block_ids(
                table_row, stride_table_col, first_tile + j * BLOCK_N, positions_end, BLOCK_N,
                BLOCK_SIZE, KV_PATH, PIECE_OFFSET, PIECE_SIZE, False, False,
            )  # fmt: skip
        if DESCRIPTOR_LOADS:
            k, v = _k8v8_descriptor_tiles(
                descs, k_id0, k_slot, v_id0, v_slot, BLOCK_SIZE, BLOCK_N, BLOCK_D, V_KEYS_MAJOR
            )
            k_col = descs[4].load([v_id0 * k_scales[1] + descs[6] + v_slot])
        else:
            k = _unmasked_tile(
                k_cache, descs[0], descs[2], k_tile, k_id0, k_id1, k_ids, k_start, BLOCK_N,
                BLOCK_D, HEAD_DIM, BLOCK_SIZE, KV_PATH, OFFSETS_32, PIECE_OFFSET, PIECE_SIZE,
                False, SCALAR_BASE, False, True,
            )  # fmt: skip
            v = _unmasked_tile(
                v_cache, descs[1], descs[2], v_tile, v_id0, v_id1, v_ids, v_start, BLOCK_N,
                BLOCK_D, HEAD_DIM, BLOCK_SIZE, KV_PATH, OFFSETS_32, PIECE_OFFSET, PIECE_SIZE,
                False, SCALAR_BASE, V_KEYS_MAJOR,
            )  # fmt: skip
            ks_rows = _tile_rows(
                v_id0, v_id1, v_ids, v_start, k_scales, BLOCK_N, BLOCK_SIZE, KV_PATH,
                OFFSETS_32, PIECE_OFFSET, PIECE_SIZE, SCALES_KEYS_MAJOR, False,
            )  # fmt: skip
            k_col = _load_scales(k_scales[0], ks_rows, 0, False, WIDE_SCALES, BLOCK_N)
        k_col = _in_fp8_mma_key_order(k_col, BLOCK_N)
        if not V_KEYS_MAJOR:
            v = v.to(tl.float8e4nv, bitcast=True)
        next_qk = tl.dot(q, tl.trans(k))
        if V_BLOCK_SCALES:
            v_channels = _v_block_channels(v_scales, v_id0, HEAD_DIM, BLOCK_D)
        else:
            v_channels = 1.0
        acc, row_max, row_sum, qk = _k8v8_step(
            (acc, row_max, row_sum), qk, next_qk, k_col, v, v_channels, ones, scale_log2,
            j == 0, BLOCK_N, V_BLOCK_SCALES, INTERPRETED, SCORE_BITS,
        )  # fmt: skip
        k_id0, k_id1, k_ids = next_k_id0, next_k_id1, next_k_ids
        v_id0, v_id1, v_ids = (next_v_id0, next_v_id1, next_v_ids)
        # V's next tile is this K's (as its ids): its slot carried, not computed again.
        v_slot = k_slot
        k_slot = next_k_slot
    return acc, row_max, row_sum


@triton.jit
def _attend_pv_behind(
    state,
    q,
    caches,
    descs,
    table,
    first_tile,
    num_tiles,
    positions_end,
    scale_log2,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_PATH: tl.constexpr,
    OFFSETS_32: tl.constexpr,
    V_KEYS_MAJOR: tl.constexpr,
    SCALES_KEYS_MAJOR: tl.constexpr,
    WIDE_SCALES: tl.constexpr,
    K8V16: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    TMA: tl.constexpr,
    SCORE_BITS: tl.constexpr,
    PIECE_OFFSET: tl.constexpr,
    PIECE_SIZE: tl.constexpr,
):
    """``_attend_tiles``' unmasked loop over k8v8 or (``K8V16``) k8v16 caches for tiles inside
    one block (tile j at ``first_tile + j * BLOCK_N``) with each tile's ``P V`` MMA running
    under the next tile's softmax (FlashAttention-3's overlap within a warpgroup): iteration j
    issues tile j's int8 ``Q K^T`` MMA (Triton waits for it at once), then tile j - 1's ``P V``
    MMA over the probabilities carried from last iteration, then runs tile j's softmax while
    that MMA runs. Triton leaves a dot in flight across iterations only if its accumulator is
    float32, so it is the ``P V`` MMA that can run under a softmax: the int8 score MMA issued a
    tile ahead (``_attend_k8v8_ahead``) is waited for right after its issue.

    k8v8's FP8 ``P V`` sums into an accumulator of its own (its ~13-bit sums span one tile),
    added into the float32 acc the next iteration, after that iteration's score MMA wait (and
    the last after the loop); k8v16's 16-bit ``P V`` accumulates into acc in place, rescaled
    before it issues.

    Iteration j reads K's rows and scales of tile ``min(j, last)`` and V's of tile ``max(j - 1,
    0)``; iteration 0 issues a ``P V`` of zero probabilities and the last takes no softmax step
    (``num_tiles + 1`` iterations). The probabilities are carried in float32 and converted at
    the MMA: carried as e4m3 codes, each code sat in a register of its own and was packed again
    for the MMA (about 100 instructions more a 64-key tile, on both Tritons). 64-key tiles only:
    at 128 keys the carried probabilities beside a tile of scores spilled on both Tritons
    (docs/quantization.md), and those tiles keep ``_attend_k8v8_ahead`` (k8v8) or
    ``_attend_tiles`` (k8v16); so do k8v8's per-block V channel scales (their 64 channels a
    thread, loaded for the deferred add, spilled 12-76 bytes): V's scales here are the frozen
    ones, applied in the epilogue."""
    acc, row_max, row_sum = state
    if not K8V16:
        ones = _sums_operand(BLOCK_N)
    k_cache = caches[0]
    v_cache = caches[1]
    k_scales = caches[2]
    table_row, stride_table_col = table
    # k8v8: a slot-major V is read as bytes (as _attend_tiles reads it) and transposed in the
    # loop; K's rows (and scales) in the 8-bit MMA's key order, so P feeds the FP8 MMA as is.
    v_head = v_cache[0] if V_KEYS_MAJOR or K8V16 else v_cache[0].to(tl.pointer_type(tl.uint8))
    # Tiles inside one block take a scalar base (and descriptors); tiles gathered from the
    # pieces of several blocks (the rows path, small pieces) per-row offsets from their ids.
    SCALAR_BASE: tl.constexpr = PIECE_SIZE % BLOCK_N == 0
    k_tile, v_tile = _key_tile_pointers(
        k_cache[0], k_cache, v_head, v_cache, BLOCK_N, BLOCK_D, SCALAR_BASE, not K8V16
    )
    last = num_tiles - 1
    rows: tl.constexpr = q.shape[0]
    # Carried: k8v8's P V sum issued last iteration (pv, with its rescale) and the
    # probabilities the next P V MMA takes (with theirs).
    pv = tl.zeros([rows, BLOCK_D], dtype=tl.float32)
    probs = tl.zeros([rows, BLOCK_N], dtype=tl.float32)
    pv_rescale = tl.full([rows], 1.0, dtype=tl.float32)
    p_rescale = pv_rescale
    k_id0, k_id1, k_ids = _tile_block_ids(
        table_row, stride_table_col, first_tile, positions_end, BLOCK_N, BLOCK_SIZE, KV_PATH,
        PIECE_OFFSET, PIECE_SIZE, False, False,
    )  # fmt: skip
    v_id0, v_id1, v_ids = k_id0, k_id1, k_ids
    steps = num_tiles + (num_tiles > 0)  # the tiles, and a P V after the last softmax
    for j in range(steps):
        k_start = first_tile + tl.minimum(j, last) * BLOCK_N
        v_start = first_tile + BLOCK_N * tl.maximum(j - 1, 0)
        next_k_id0, next_k_id1, next_k_ids = _tile_block_ids(
            table_row, stride_table_col, first_tile + tl.minimum(j + 1, last) * BLOCK_N,
            positions_end, BLOCK_N, BLOCK_SIZE, KV_PATH, PIECE_OFFSET, PIECE_SIZE, False, False,
        )  # fmt: skip
        if SCALAR_BASE:
            # V's next tile is this K's: its one id carried.
            next_v_id0, next_v_id1, next_v_ids = k_id0, k_id1, k_ids
        else:
            # A gathered tile's ids read apart for V: carried two iterations from K's, they
            # cost Triton 3.9's pipeliner the K tile's prefetch (stored through registers).
            next_v_id0, next_v_id1, next_v_ids = _tile_block_ids(
                table_row, stride_table_col, first_tile + j * BLOCK_N, positions_end, BLOCK_N,
                BLOCK_SIZE, KV_PATH, PIECE_OFFSET, PIECE_SIZE, False, False,
            )  # fmt: skip
        k_slot = PIECE_OFFSET + k_start % PIECE_SIZE
        v_slot = PIECE_OFFSET + v_start % PIECE_SIZE
        if TMA and SCALAR_BASE and K8V16:
            k = descs[0].load([k_id0 * BLOCK_SIZE + k_slot, descs[2]])
            v = descs[1].load([v_id0 * BLOCK_SIZE + v_slot, descs[2]])
        elif TMA and SCALAR_BASE:
            k, v = _k8v8_descriptor_tiles(
                descs, k_id0, k_slot, v_id0, v_slot, BLOCK_SIZE, BLOCK_N, BLOCK_D, V_KEYS_MAJOR
            )
        else:
            # K's rows in the 8-bit MMA's key order (k8v8), V's in position order.
            k = _unmasked_tile(
                k_cache, descs[0], descs[2], k_tile, k_id0, k_id1, k_ids, k_start, BLOCK_N,
                BLOCK_D, HEAD_DIM, BLOCK_SIZE, KV_PATH, OFFSETS_32, PIECE_OFFSET, PIECE_SIZE,
                False, SCALAR_BASE, False, not K8V16,
            )  # fmt: skip
            v = _unmasked_tile(
                v_cache, descs[1], descs[2], v_tile, v_id0, v_id1, v_ids, v_start, BLOCK_N,
                BLOCK_D, HEAD_DIM, BLOCK_SIZE, KV_PATH, OFFSETS_32, PIECE_OFFSET, PIECE_SIZE,
                False, SCALAR_BASE, V_KEYS_MAJOR,
            )  # fmt: skip
        if TMA and SCALAR_BASE:
            k_col = descs[4].load([k_id0 * k_scales[1] + descs[6] + k_slot])
        else:
            ks_rows = _tile_rows(
                k_id0, k_id1, k_ids, k_start, k_scales, BLOCK_N, BLOCK_SIZE, KV_PATH,
                OFFSETS_32, PIECE_OFFSET, PIECE_SIZE, SCALES_KEYS_MAJOR, False,
            )  # fmt: skip
            k_col = _load_scales(k_scales[0], ks_rows, 0, False, WIDE_SCALES, BLOCK_N)
        if not K8V16:
            k_col = _in_fp8_mma_key_order(k_col, BLOCK_N)
        if K8V16 and UPCAST:
            v = v.to(tl.float32)
        elif not (K8V16 or V_KEYS_MAJOR):
            v = v.to(tl.float8e4nv, bitcast=True)
        # k8v8: the carried probabilities' row sums, with their rescale, before P V (Triton
        # waits for each such MMA at once, and for every MMA before it). Gathered tiles take
        # them before the score MMA too, while its int32 tile is not yet live (between it and
        # P V, Triton 3.9 spilled 24 bytes at block 24); tiles inside a block after it (before
        # it, block 64's loop on Triton 3.6 issued 1.8x the instructions with no MMA in flight).
        SUMS_FIRST: tl.constexpr = not K8V16 and not SCALAR_BASE
        if SUMS_FIRST:
            p_codes = _fp8_operand(to_e4m3(probs, INTERPRETED), BLOCK_N)
            row_sum = _add_row_sums(row_sum, p_rescale, p_codes, ones)
        qk = tl.dot(q, tl.trans(k))
        if K8V16:
            acc = tl.dot(
                probs.to(v.dtype), v, acc * p_rescale[:, None], input_precision=DOT_PRECISION
            )
        else:
            acc = acc * pv_rescale[:, None] + pv
            if not SUMS_FIRST:
                p_codes = _fp8_operand(to_e4m3(probs, INTERPRETED), BLOCK_N)
                row_sum = _add_row_sums(row_sum, p_rescale, p_codes, ones)
            pv = tl.dot(p_codes, v)
            pv_rescale = p_rescale
        probs, p_rescale, row_max = _int8_scores_softmax(
            qk, k_col, row_max, scale_log2, j == num_tiles, not K8V16, SCORE_BITS, INTERPRETED
        )
        if K8V16:
            row_sum = row_sum * p_rescale + tl.sum(probs, axis=1)
        v_id0, v_id1, v_ids = next_v_id0, next_v_id1, next_v_ids
        k_id0, k_id1, k_ids = next_k_id0, next_k_id1, next_k_ids
    if not K8V16:
        acc = acc * pv_rescale[:, None] + pv
    return acc, row_max, row_sum


@triton.jit
def _k8v8_step(
    state,
    qk,
    next_qk,
    k_col,
    v,
    v_channels,
    ones,
    scale_log2,
    skip,
    BLOCK_N: tl.constexpr,
    V_BLOCK_SCALES: tl.constexpr,
    INTERPRETED: tl.constexpr,
    SCORE_BITS: tl.constexpr,
):
    """An unmasked k8v8 tile's online-softmax step (``_attend_tiles``' k8v8 arithmetic) from
    its float scores (int8 sums, K in ``_fp8_mma_key_order``), K's scales by score column, V's
    e4m3 tile and (``V_BLOCK_SCALES``) its block's channel scales, the row sums by MMA over
    ``ones`` (``_sums_operand``, ``_add_row_sums``); where the scalar
    ``skip`` holds, none (as ``_pv_step``). Returns the state and ``next_qk`` (the next tile's
    int32 scores) in float, converted after the ``P V`` MMA is issued and before its flush
    (carried as int32 and converted at the step, 8 instructions more issued with no MMA in
    flight at block 1560; ``SCORE_BITS``: biased, ``_scores_in_float``)."""
    acc, row_max, row_sum = state
    probs, rescale, row_max = _int8_scores_softmax(
        qk, k_col, row_max, scale_log2, skip, True, SCORE_BITS, INTERPRETED
    )
    p_codes = _fp8_operand(to_e4m3(probs, INTERPRETED), BLOCK_N)
    # The row sums' MMA first: Triton waits for each at once, and for every MMA before it.
    row_sum = _add_row_sums(row_sum, rescale, p_codes, ones)
    pv = tl.dot(p_codes, v)
    next_scores = _scores_in_float(next_qk, SCORE_BITS, INTERPRETED)
    acc = _k8v8_flush(acc, pv, rescale, v_channels, V_BLOCK_SCALES)
    return acc, row_max, row_sum, next_scores


@triton.jit
def _biased_scores(scores, INTERPRETED: tl.constexpr):
    """int32 MMA sums ``s`` (8-bit codes over head_dim <= 256: ``|s| < 2**22``) as float32
    ``SCORE_BIAS + s``, exactly, by an integer add of ``SCORE_BIAS``'s bits: no int-to-float
    conversion (``I2FP``), whose pipe may be the exponentials' (``bench.pipe_probe``). The add
    is inline PTX: Triton folds a plain ``dot + constant`` into the MMA's accumulator, which
    is then set before each score MMA, a move a score with no MMA in flight."""
    if INTERPRETED:
        bits = scores + SCORE_BIAS_BITS
    else:
        bits = tl.inline_asm_elementwise(
            "add.s32 $0, $1, 1262485504;", "=r,r", [scores], dtype=tl.int32, is_pure=True,
            pack=1,
        )  # fmt: skip
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scores_in_float(sums, SCORE_BITS: tl.constexpr, INTERPRETED: tl.constexpr):
    """An 8-bit ``Q K^T``'s int32 sums in float32 for ``_k_scaled``: converted, exactly
    (``|s| <= 256 * 127**2 < 2**24``), or (``SCORE_BITS``) biased, ``_biased_scores``. Scores
    already in float (carried from the iteration that took them) pass as they are."""
    if sums.dtype != tl.int32:
        return sums
    if SCORE_BITS:
        return _biased_scores(sums, INTERPRETED)
    return sums.to(tl.float32)


@triton.jit
def _k_scaled(scores, k_col, SCORE_BITS: tl.constexpr):
    """Scores in float (``_scores_in_float``) times K's scales by column. ``SCORE_BITS``:
    ``(SCORE_BIAS + s) * k - SCORE_BIAS * k``, one FFMA a score (its addend one FMUL a column),
    ``s * k`` to within the addend's rounding (0.75 k: under a unit of ``s``)."""
    if SCORE_BITS:
        return scores * k_col[None, :] - (k_col * SCORE_BIAS)[None, :]
    return scores * k_col[None, :]


@triton.jit
def _int8_scores_softmax(
    scores,
    k_col,
    row_max,
    scale_log2,
    skip,
    E4M3_P: tl.constexpr,
    SCORE_BITS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """An 8-bit ``Q K^T`` tile's online-softmax step up to ``P V``: its scores (int8 sums, in
    float or int32: ``_scores_in_float``) times K's scales by column; returns the probabilities
    (``E4M3_P``, k8v8's: biased so that a row's largest is 448, e4m3's largest), their row
    rescale and the new row maxima (the row sums are the caller's: k8v8's by MMA). Where the
    scalar ``skip`` holds, none: every probability 0, rescale 1, the row maxima as they were."""
    scores = _k_scaled(_scores_in_float(scores, SCORE_BITS, INTERPRETED), k_col, SCORE_BITS)
    new_max = tl.where(skip, row_max, tl.maximum(row_max, tl.max(scores, axis=1) * scale_log2))
    # Subtracting +inf makes every probability 0 (scale_log2 >= 0, as in _attend_tiles).
    if E4M3_P:
        bias = tl.where(skip, float("inf"), new_max - LOG2_E4M3_MAX)
    else:
        bias = tl.where(skip, float("inf"), new_max)
    probs = tl.math.exp2(scores * scale_log2[:, None] - bias[:, None])
    rescale = tl.math.exp2(tl.where(skip, 0.0, row_max - new_max))
    return probs, rescale, new_max


@triton.jit
def _sums_operand(BLOCK_N: tl.constexpr):
    """The ``[BLOCK_N, SUM_COLUMNS]`` e4m3 operand of ``_add_row_sums``' MMA: ones in column 0,
    zeros elsewhere, so a row of the product holds its probabilities' sum and zeros (``tl.sum``
    over the row gives it back exactly). Made once before a loop. Summing the e4m3
    probabilities in the loop took an add per probability (64 a thread per 128 x 128 tile at 8
    warps, an eighth of k8v8's loop, which its issue slots bound: docs/quantization.md); the MMA
    adds an eighth to the ``P V`` MMA's work."""
    columns = tl.arange(0, SUM_COLUMNS)
    ones = tl.where(columns[:, None] == 0, 1.0, 0.0) + tl.zeros([SUM_COLUMNS, BLOCK_N], tl.float32)
    return tl.trans(ones).to(tl.float8e4nv)


@triton.jit
def _add_row_sums(row_sum, rescale, p_codes, ones):
    """Float32 row sums rescaled, plus a tile's e4m3 probabilities ``p_codes`` summed by an FP8
    MMA over ``ones`` (``_sums_operand``): the rounded probabilities ``P V`` takes, through the
    same ~13-bit accumulator, added into float32 once a tile as ``P V``'s sums are
    (``reference.eight_bit_attention``'s ``"rounded"`` normalizer)."""
    return row_sum * rescale + tl.sum(tl.dot(p_codes, ones), axis=1)


@triton.jit
def _k8v8_flush(acc, pv, rescale, v_channels, V_BLOCK_SCALES: tl.constexpr):
    """A tile's FP8 ``P V`` MMA sum added into the float32 ``acc`` (rescaled first), times its
    block's channel scales where V's are per block (``V_BLOCK_SCALES``)."""
    if V_BLOCK_SCALES:
        return acc * rescale[:, None] + pv * v_channels[None, :]
    return acc * rescale[:, None] + pv


@triton.jit
def _v_block_channels(v_scales, block_id, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Block ``block_id``'s V channel scales (k8v8 with per-block scales), 0 past the head."""
    offs_d = tl.arange(0, BLOCK_D)
    return tl.load(
        v_scales[0] + block_id.to(tl.int64) * v_scales[1] + offs_d * v_scales[2],
        mask=offs_d < HEAD_DIM,
        other=0.0,
    )


@triton.jit
def _pv_step(state, qk, v, scale_log2, skip, DOT_PRECISION: tl.constexpr):
    """An unmasked 16-bit tile's online-softmax step from its scores ``qk`` and V tile; where
    the scalar ``skip`` holds, none: the state comes back as it was (``qk`` and ``v`` finite,
    the probabilities all 0), at a few selects per row rather than per score."""
    acc, row_max, row_sum = state
    new_max = tl.where(skip, row_max, tl.maximum(row_max, tl.max(qk, axis=1) * scale_log2))
    # scale_log2 >= 0, as in _attend_tiles; subtracting +inf makes every probability 0.
    probs = tl.math.exp2(qk * scale_log2 - tl.where(skip, float("inf"), new_max)[:, None])
    rescale = tl.where(skip, 1.0, tl.math.exp2(row_max - new_max))
    row_sum = row_sum * rescale + tl.sum(probs, axis=1)
    acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, new_max, row_sum


@triton.jit
def _attend_block_pairs(
    state,
    q,
    descs,
    table,
    first_tile,
    num_tiles,
    positions_end,
    scale_log2,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    AHEAD: tl.constexpr,
):
    """The unmasked loop over 16-bit key tiles of two whole blocks (``BLOCK_N == 2 *
    BLOCK_SIZE``, tiles starting on block edges: the rows path's at block 64 and 128 keys) by
    descriptor: each block's K and V rows are one load (a descriptor box is ``BLOCK_SIZE``
    rows), the two halves' scores one online-softmax step, so the accumulator is rescaled once
    per ``BLOCK_N`` keys, as a tile inside one block is (``state`` as in ``_attend_tiles``).
    ``AHEAD``: the scores one tile ahead, as in ``_attend_tiles_ahead`` (iteration j reads K of
    tile ``min(j, last)`` and V of tile ``max(j - 1, 0)``; iteration 0 takes no step)."""
    table_row, stride_table_col = table
    k_id0, k_id1, _ = _tile_block_ids(
        table_row, stride_table_col, first_tile, positions_end, BLOCK_N, BLOCK_SIZE,
        "two_blocks", 0, BLOCK_SIZE, False, False,
    )  # fmt: skip
    if AHEAD:
        last = num_tiles - 1
        qk0 = tl.zeros([q.shape[0], BLOCK_SIZE], dtype=tl.float32)
        qk1 = tl.zeros([q.shape[0], BLOCK_SIZE], dtype=tl.float32)
        v_id0, v_id1 = k_id0, k_id1
    for j in range(0, num_tiles + (AHEAD and num_tiles > 0)):
        # The next tile's block ids first (its loads are issued a whole iteration early); with
        # the scores ahead, K's and V's apart (as _attend_tiles_ahead reads them).
        if AHEAD:
            k_next = first_tile + tl.minimum(j + 1, last) * BLOCK_N
        else:
            k_next = first_tile + (j + 1) * BLOCK_N
        next_k_id0, next_k_id1, _ = _tile_block_ids(
            table_row, stride_table_col, k_next, positions_end, BLOCK_N, BLOCK_SIZE,
            "two_blocks", 0, BLOCK_SIZE, False, False,
        )  # fmt: skip
        if AHEAD:
            next_v_id0, next_v_id1, _ = _tile_block_ids(
                table_row, stride_table_col, first_tile + j * BLOCK_N, positions_end, BLOCK_N,
                BLOCK_SIZE, "two_blocks", 0, BLOCK_SIZE, False, False,
            )  # fmt: skip
        else:
            v_id0, v_id1 = k_id0, k_id1
        k0 = descs[0].load([k_id0 * BLOCK_SIZE, descs[2]])
        k1 = descs[0].load([k_id1 * BLOCK_SIZE, descs[2]])
        v0 = descs[1].load([v_id0 * BLOCK_SIZE, descs[2]])
        v1 = descs[1].load([v_id1 * BLOCK_SIZE, descs[2]])
        if UPCAST:
            k0, k1 = k0.to(tl.float32), k1.to(tl.float32)
            v0, v1 = v0.to(tl.float32), v1.to(tl.float32)
        next_qk0 = tl.dot(q, tl.trans(k0), input_precision=DOT_PRECISION)
        next_qk1 = tl.dot(q, tl.trans(k1), input_precision=DOT_PRECISION)
        if AHEAD:
            state = _pair_step(state, qk0, qk1, v0, v1, scale_log2, j == 0, DOT_PRECISION)
            qk0, qk1 = next_qk0, next_qk1
            v_id0, v_id1 = next_v_id0, next_v_id1
        else:
            state = _pair_step(state, next_qk0, next_qk1, v0, v1, scale_log2, False, DOT_PRECISION)
        k_id0, k_id1 = next_k_id0, next_k_id1
    return state


@triton.jit
def _pair_step(state, qk0, qk1, v0, v1, scale_log2, skip, DOT_PRECISION: tl.constexpr):
    """The online-softmax step of a tile of two blocks' scores ``qk0``, ``qk1`` and V tiles
    (``_pv_step``'s ``skip``: the state comes back as it was)."""
    acc, row_max, row_sum = state
    # scale_log2 >= 0: the scaled maximum is the maximum scaled (as in _attend_tiles).
    # One reduction over both halves (their elements paired first): one round of shuffles.
    tile_max = tl.max(tl.maximum(qk0, qk1), axis=1)
    new_max = tl.where(skip, row_max, tl.maximum(row_max, tile_max * scale_log2))
    # Subtracting +inf makes every probability 0.
    row_shift = tl.where(skip, float("inf"), new_max)[:, None]
    probs0 = tl.math.exp2(qk0 * scale_log2 - row_shift)
    probs1 = tl.math.exp2(qk1 * scale_log2 - row_shift)
    rescale = tl.where(skip, 1.0, tl.math.exp2(row_max - new_max))
    row_sum = row_sum * rescale + tl.sum(probs0 + probs1, axis=1)
    acc = acc * rescale[:, None]
    acc = tl.dot(probs0.to(v0.dtype), v0, acc, input_precision=DOT_PRECISION)
    acc = tl.dot(probs1.to(v1.dtype), v1, acc, input_precision=DOT_PRECISION)
    return acc, new_max, row_sum


@triton.jit
def _piece_position(
    key, BLOCK_SIZE: tl.constexpr, PIECE_OFFSET: tl.constexpr, PIECE_SIZE: tl.constexpr
):
    """Where ``key`` falls among the keys of the blocks' pieces ``[PIECE_OFFSET, PIECE_OFFSET +
    PIECE_SIZE)``, in block order: a key before its block's piece falls on the piece's first
    key, one after it on the next block's."""
    if PIECE_SIZE == BLOCK_SIZE:
        return key
    else:
        inside = tl.minimum(tl.maximum(key % BLOCK_SIZE - PIECE_OFFSET, 0), PIECE_SIZE)
        return key // BLOCK_SIZE * PIECE_SIZE + inside


@triton.jit
def _attend_piece(
    state,
    q,
    caches,
    descs,
    table,
    run_lo,
    run_hi,
    full_end,
    key_limit,
    scale_log2,
    p_unit,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_PATH: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    OFFSETS_32: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,
    V_KEYS_MAJOR: tl.constexpr,
    SCALES_KEYS_MAJOR: tl.constexpr,
    WIDE_SCALES: tl.constexpr,
    K8V8: tl.constexpr,
    V_BLOCK_SCALES: tl.constexpr,
    K8V16: tl.constexpr,
    PV_DTYPE: tl.constexpr,
    INTERPRETED: tl.constexpr,
    TMA: tl.constexpr,
    SCORES_AHEAD: tl.constexpr,
    SCORE_BITS: tl.constexpr,
    PIECE_OFFSET: tl.constexpr,
    PIECE_SIZE: tl.constexpr,
    MASKED_ONLY: tl.constexpr,
):
    """The keys of ``[run_lo, run_hi)`` in the blocks' piece ``[PIECE_OFFSET, PIECE_OFFSET +
    PIECE_SIZE)``, tiled over piece positions (``_piece_position``); every row sees all keys
    below ``full_end``. Whole tiles inside ``[run_lo, min(run_hi, full_end))`` run unmasked
    (``MASKED_ONLY``: masked, and no unmasked loop is compiled); the tile holding ``run_lo``
    and the tiles from the unmasked ones' end to ``run_hi`` run masked (``state`` as in
    ``_attend_tiles``)."""
    # 16-bit tiles of two whole blocks take descriptor loads, a block each (_attend_block_pairs).
    BLOCK_PAIRS: tl.constexpr = (
        TMA and not QUANTIZED and KV_PATH == "rows" and BLOCK_N == 2 * BLOCK_SIZE
    )
    # The scores one tile ahead (_attend_tiles_ahead): unmasked 16-bit tiles.
    AHEAD: tl.constexpr = SCORES_AHEAD and not QUANTIZED
    # k8v8's unmasked tiles, always (_attend_k8v8_ahead), but tiles gathered from pieces smaller
    # than the tile: block 24 (16 + 8) spilled 16-40 bytes so (64- and 128-key tiles), none in
    # _attend_tiles' loop.
    K8V8_AHEAD: tl.constexpr = K8V8 and (KV_PATH != "block_tiles" or PIECE_SIZE % BLOCK_N == 0)
    # k8v8's and k8v16's unmasked 64-key tiles run each P V MMA under the next softmax
    # (_attend_pv_behind; at 128 keys it spilled, 32-188 bytes): tiles inside one block, and
    # tiles gathered from several blocks' pieces, k8v8's only from a keys-major V in runs of 8
    # keys or more (8 bytes a copy: block 7's pieces of 4, 2 and 1 went through shared memory
    # and spilled 120-524 bytes).
    GATHERED_PV_BEHIND: tl.constexpr = BLOCK_N % PIECE_SIZE == 0 and (
        K8V16 or (V_KEYS_MAJOR and PIECE_SIZE % 8 == 0)
    )
    PV_BEHIND: tl.constexpr = (
        (K8V16 or (K8V8 and not V_BLOCK_SCALES))
        and BLOCK_N == 64
        and KV_PATH != "two_blocks"
        and (PIECE_SIZE % BLOCK_N == 0 or GATHERED_PV_BEHIND)
    )
    lo = _piece_position(run_lo, BLOCK_SIZE, PIECE_OFFSET, PIECE_SIZE)
    hi = _piece_position(run_hi, BLOCK_SIZE, PIECE_OFFSET, PIECE_SIZE)
    full = lo if MASKED_ONLY else _piece_position(full_end, BLOCK_SIZE, PIECE_OFFSET, PIECE_SIZE)
    full_lo = tl.cdiv(lo, BLOCK_N) * BLOCK_N
    full_hi = tl.maximum(full_lo, tl.minimum(hi, full) // BLOCK_N * BLOCK_N)
    # Masked tiles of more than 64 keys are cut in half: the masked loop (the run's edges, a
    # large block's remainder) holds masks and per-row addresses beside a tile's scores, and at
    # 128 keys it set the kernel's register peak (Triton 3.9 spilled 24 bytes at block 1560 over
    # 16-bit caches, 40-60 under FP8-MMA).
    MASKED_N: tl.constexpr = BLOCK_N // 2 if BLOCK_N > 64 else BLOCK_N
    # Pass 0, unmasked: the whole tiles. Pass 1, masked: the head tiles, from the one holding
    # run_lo to the unmasked ones' start, then the tail ones from their end to run_hi. The TMA
    # loop runs the masked pass first (MASKED_FIRST, as _attend_run its pieces): its unmasked
    # tiles are descriptor loads, so the pointers, bounds and per-row limits that only masked
    # tiles use die before the unmasked loop instead of living across it. (Unmasked first, the
    # 128-key dequantizing TMA loops spilled 16-32 bytes, on both Tritons; the pointer loops,
    # which use them in both passes, gain nothing, and on Triton 3.6 lost up to 18% at
    # head_dim 256.)
    head_tiles = 0  # (unused but by half-width masked tiles)
    MASKED_FIRST: tl.constexpr = TMA and not MASKED_ONLY
    FIRST_PASS: tl.constexpr = 1 if MASKED_ONLY or MASKED_FIRST else 0
    PASS_STEP: tl.constexpr = -1 if MASKED_FIRST else 1
    PASSES_END: tl.constexpr = 2 if MASKED_ONLY else FIRST_PASS + 2 * PASS_STEP
    for masked in tl.static_range(FIRST_PASS, PASSES_END, PASS_STEP):
        if masked and MASKED_N < BLOCK_N:
            tiles_end = tl.cdiv(hi, MASKED_N) * MASKED_N
            first_tile = lo // MASKED_N * MASKED_N
            head_tiles = tl.maximum(tl.minimum(full_lo, tiles_end) - first_tile, 0) // MASKED_N
            tiles_start = full_hi  # >= full_lo: the head tiles end first
            num_tiles = head_tiles + tl.maximum(tiles_end - tiles_start, 0) // MASKED_N
        elif masked:
            # The head tile when the run starts mid-tile (and it is not also the tail), then
            # the tail. (The two-base form above, at one tile, spilled 4-12 bytes more in three
            # quantized 64-key launches.)
            head_tile = lo // BLOCK_N * BLOCK_N
            tiles_end = tl.cdiv(hi, BLOCK_N) * BLOCK_N
            has_head = (head_tile < full_lo) & (full_lo <= tiles_end)
            tail_start = tl.maximum(full_hi, tl.minimum(full_lo, tiles_end))
            tail_tiles = tl.maximum(tiles_end - tail_start, 0) // BLOCK_N
            if has_head:
                first_tile = head_tile
                num_tiles = tail_tiles + 1
            else:
                first_tile = tail_start
                num_tiles = tail_tiles
                tail_start = tail_start + BLOCK_N
            tiles_start = tail_start
        else:
            first_tile = full_lo
            tiles_start = full_lo + BLOCK_N
            num_tiles = (full_hi - full_lo) // BLOCK_N
        if not masked and BLOCK_PAIRS:
            state = _attend_block_pairs(
                state, q, descs, table, first_tile, num_tiles, hi, scale_log2, BLOCK_N,
                BLOCK_SIZE, UPCAST, DOT_PRECISION, AHEAD,
            )  # fmt: skip
        elif not masked and PV_BEHIND:
            state = _attend_pv_behind(
                state, q, caches, descs, table, first_tile, num_tiles, hi, scale_log2, BLOCK_N,
                BLOCK_D, HEAD_DIM, BLOCK_SIZE, KV_PATH, OFFSETS_32, V_KEYS_MAJOR,
                SCALES_KEYS_MAJOR, WIDE_SCALES, K8V16, UPCAST, DOT_PRECISION, INTERPRETED, TMA,
                SCORE_BITS, PIECE_OFFSET, PIECE_SIZE,
            )  # fmt: skip
        elif not masked and K8V8_AHEAD:
            state = _attend_k8v8_ahead(
                state, q, caches, descs, table, first_tile, num_tiles, hi, scale_log2, BLOCK_N,
                BLOCK_D, HEAD_DIM, BLOCK_SIZE, KV_PATH, OFFSETS_32, V_KEYS_MAJOR,
                SCALES_KEYS_MAJOR, WIDE_SCALES, V_BLOCK_SCALES, INTERPRETED, TMA, SCORE_BITS,
                PIECE_OFFSET, PIECE_SIZE,
            )  # fmt: skip
        elif not masked and AHEAD:
            state = _attend_tiles_ahead(
                state, q, caches, descs, table, first_tile, num_tiles, hi, scale_log2, BLOCK_N,
                BLOCK_D, HEAD_DIM, BLOCK_SIZE, KV_PATH, OFFSETS_32, UPCAST, DOT_PRECISION, TMA,
                PIECE_OFFSET, PIECE_SIZE,
            )  # fmt: skip
        else:
            state = _attend_tiles(
                state,
                q,
                caches,
                descs,
                table,
                first_tile,
                head_tiles,
                tiles_start,
                num_tiles,
                run_lo,
                run_hi,
                hi,
                key_limit,
                scale_log2,
                p_unit,
                MASKED_N if masked else BLOCK_N,
                BLOCK_D,
                HEAD_DIM,
                BLOCK_SIZE,
                KV_PATH,
                SAME_KV_STRIDES,
                OFFSETS_32,
                masked == 1,
                UPCAST,
                DOT_PRECISION,
                QUANTIZED,
                V_KEYS_MAJOR,
                SCALES_KEYS_MAJOR,
                WIDE_SCALES,
                K8V8,
                V_BLOCK_SCALES,
                K8V16,
                PV_DTYPE,
                INTERPRETED,
                TMA,
                SCORE_BITS,
                PIECE_OFFSET,
                PIECE_SIZE,
                BLOCK_N // MASKED_N,
            )
    return state


@triton.jit
def _attend_run(
    state,
    q,
    caches,
    descs,
    table,
    run_lo,
    run_hi,
    full_end,
    key_limit,
    scale_log2,
    p_unit,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PIECES: tl.constexpr,
    KV_PATH: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    OFFSETS_32: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,
    V_KEYS_MAJOR: tl.constexpr,
    SCALES_KEYS_MAJOR: tl.constexpr,
    WIDE_SCALES: tl.constexpr,
    K8V8: tl.constexpr,
    V_BLOCK_SCALES: tl.constexpr,
    K8V16: tl.constexpr,
    PV_DTYPE: tl.constexpr,
    INTERPRETED: tl.constexpr,
    TMA: tl.constexpr,
    SCORES_AHEAD: tl.constexpr,
    SCORE_BITS: tl.constexpr,
):
    """Keys ``[run_lo, run_hi)``, visible to rows up to their limits; every row sees all keys
    below ``full_end`` (``state`` as in ``_attend_tiles``). ``PIECES`` cut each block into
    pieces ``(offset, size, masked only)``, in block order (one, the whole block, but on
    ``block_tiles``); each piece's keys over all blocks are attended one piece after the other
    (softmax does not depend on the order keys are seen in). The remainder of a block larger
    than the tile (1.5% of the keys at blocks 520 and 1560) runs masked only: an unmasked loop
    of per-row table reads would be the kernel's longest loop for the fewest keys."""
    for i in tl.static_range(len(PIECES)):
        # The TMA loop takes the first piece (the only one descriptors load) last: the values
        # the pointer pieces use die before it (see _attend_piece's MASKED_FIRST). (The piece
        # is indexed in place: a name assigned a constexpr inside the loop becomes a tensor.)
        if i > 0:
            run_lo = _unknown_again(run_lo, INTERPRETED)
            run_hi = _unknown_again(run_hi, INTERPRETED)
            full_end = _unknown_again(full_end, INTERPRETED)
        state = _attend_piece(
            state,
            q,
            caches,
            descs,
            table,
            run_lo,
            run_hi,
            full_end,
            key_limit,
            scale_log2,
            p_unit,
            BLOCK_N,
            BLOCK_D,
            HEAD_DIM,
            BLOCK_SIZE,
            KV_PATH,
            SAME_KV_STRIDES,
            OFFSETS_32,
            UPCAST,
            DOT_PRECISION,
            QUANTIZED,
            V_KEYS_MAJOR,
            SCALES_KEYS_MAJOR,
            WIDE_SCALES,
            K8V8,
            V_BLOCK_SCALES,
            K8V16,
            PV_DTYPE,
            INTERPRETED,
            TMA,
            SCORES_AHEAD,
            SCORE_BITS,
            PIECES[(i + TMA) % len(PIECES)][0],
            PIECES[(i + TMA) % len(PIECES)][1],
            PIECES[(i + TMA) % len(PIECES)][2],
        )
    return state


@triton.heuristics(
    {
        "HAS_KEY_LIMITS": lambda args: args["key_limits_ptr"] is not None,
        "HAS_KEY_GAP": lambda args: args["key_gap_ptr"] is not None,
        "QUANTIZED": lambda args: args["k_scale_ptr"] is not None,
        "HAS_LSE": lambda args: args["lse_ptr"] is not None,
        "HAS_K_EQUALIZER": lambda args: args["k_equalizer_ptr"] is not None,
        "HAS_V_EQUALIZER": lambda args: args["v_equalizer_ptr"] is not None,
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
    k_equalizer_ptr,
    v_equalizer_ptr,
    q_scale_ptr,
    v_unit_ptr,
    scale_log2,
    gaps_per_row,
    pool_rows,
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    stride_qs_tok,
    stride_qs_head,
    stride_vu_seq,
    stride_vu_head,
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
    stride_keq_head,
    stride_keq_dim,
    stride_veq_head,
    stride_veq_dim,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PIECES: tl.constexpr,
    KV_PATH: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    OFFSETS_32: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_KEY_LIMITS: tl.constexpr,
    HAS_KEY_GAP: tl.constexpr,
    GAPS: tl.constexpr,
    QUANTIZED: tl.constexpr,
    V_KEYS_MAJOR: tl.constexpr,
    SCALES_KEYS_MAJOR: tl.constexpr,
    WIDE_SCALES: tl.constexpr,
    K8V8: tl.constexpr,
    V_BLOCK_SCALES: tl.constexpr,
    K8V16: tl.constexpr,
    PV_DTYPE: tl.constexpr,
    INTERPRETED: tl.constexpr,
    HAS_LSE: tl.constexpr,
    HAS_K_EQUALIZER: tl.constexpr,
    HAS_V_EQUALIZER: tl.constexpr,
    TMA: tl.constexpr,
    SCORES_AHEAD: tl.constexpr,
    SCORE_BITS: tl.constexpr,
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

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    query, head, m_mask = _program_rows(tile_m, kv_head, q_len, BLOCK_M, GROUP)
    io_mask = m_mask[:, None] & d_mask[None, :]
    q_rows = (q_start + query).to(tl.int64)
    q = tl.load(
        q_ptr
        + q_rows[:, None] * stride_q_tok
        + head[:, None].to(tl.int64) * stride_q_head
        + offs_d[None, :] * stride_q_dim,
        mask=io_mask,
        other=0.0,
    )
    if UPCAST and not K8V8 and not K8V16:
        q = q.to(tl.float32)
    # int8 K under a bfloat16 q: Q K^T as a float16 MMA (_float16_rows). Not past 128
    # channels: at head_dim 256 the (since deleted) e4m3 loop then spilled 20-108 bytes on
    # Triton 3.6 (its 32-key bfloat16 loop spills none; 3.9 spilled neither way).
    FLOAT16_QK: tl.constexpr = (
        q_ptr.dtype.element_ty == tl.bfloat16
        and k_ptr.dtype.element_ty == tl.int8
        and BLOCK_D <= 128
    )
    if HAS_K_EQUALIZER:
        # K was stored divided by these factors: q times them keeps every q.k (powers of two,
        # as chosen: exact in q's dtype).
        k_factor = tl.load(
            k_equalizer_ptr + kv_head * stride_keq_head + offs_d * stride_keq_dim,
            mask=d_mask,
            other=1.0,
        )
        q = (q.to(tl.float32) * k_factor[None, :]).to(q.dtype)
    if K8V8 or K8V16:
        # q holds the rows' int8 codes (query_codes.py, K's channel factors folded in); each
        # row's scale folds into the softmax scale.
        q_scale = tl.load(
            q_scale_ptr + q_rows * stride_qs_tok + head * stride_qs_head, mask=m_mask, other=0.0
        )
        scale_log2 = q_scale * scale_log2
    elif QUANTIZED and FLOAT16_QK:
        q, q_factor = _float16_rows(q)
        scale_log2 = scale_log2 / q_factor
    elif QUANTIZED:
        scale_log2 = tl.zeros([BLOCK_M], dtype=tl.float32) + scale_log2

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
    p_unit = 1.0
    if QUANTIZED and not K8V8 and not K8V16:
        # acc is the output in units of p_unit (value_units.probability_units).
        p_unit = tl.load(v_unit_ptr + seq * stride_vu_seq + kv_head * stride_vu_head)
    table = (block_table_ptr + seq.to(tl.int64) * stride_table_row, stride_table_col)
    # Each pool of this KV head as (head pointer, block stride, slot stride[, dim stride]): K and
    # V, then the K and V scales of quantized pools.
    kv_head_i64 = kv_head.to(tl.int64)
    caches = (
        (k_ptr + kv_head_i64 * stride_k_head, stride_k_block, stride_k_slot, stride_k_dim),
        (v_ptr + kv_head_i64 * stride_v_head, stride_v_block, stride_v_slot, stride_v_dim),
    )
    if QUANTIZED:
        caches = (
            caches[0],
            caches[1],
            (k_scale_ptr + kv_head_i64 * stride_ks_head, stride_ks_block, stride_ks_slot),
            (v_scale_ptr + kv_head_i64 * stride_vs_head, stride_vs_block, stride_vs_slot),
        )

    if TMA:
        # Each pool as a 2-D tensor of (block, slot) rows and (KV head, channel) columns: a key
        # tile inside one block is one descriptor load (the launcher checked the layout). A
        # keys-major V pool (k8v8) reads as (block, KV head, channel) rows of slots instead.
        row = tl.num_programs(2) * HEAD_DIM
        # A box of a tile's rows; of a block's, where a tile is two whole blocks.
        BLOCK_PAIRS: tl.constexpr = (
            TMA and not QUANTIZED and KV_PATH == "rows" and BLOCK_N == 2 * BLOCK_SIZE
        )
        TMA_ROWS: tl.constexpr = BLOCK_SIZE if BLOCK_PAIRS else BLOCK_N
        if K8V8:
            # K's rows as (run of 16, j, q, b), element (r, j, q, b) at row 16 r + 2j + 4q + b:
            # a box's rows, stored in (j, q, b) order, are each run's in _fp8_mma_key_order. A
            # tile's first row gives the run and b's start (a tile may start mid-run: block
            # 1560 at odd block ids); b's extent, 17, admits starts up to 15.
            k_desc = tl.make_tensor_descriptor(
                k_ptr,
                [tl.maximum(pool_rows // 16, 1), 2, 4, 17, row],
                [16 * stride_k_slot, 2 * stride_k_slot, 4 * stride_k_slot, stride_k_slot, 1],
                [BLOCK_N // 16, 2, 4, 2, BLOCK_D],
            )
        else:
            k_desc = tl.make_tensor_descriptor(
                k_ptr, [pool_rows, row], [stride_k_slot, 1], [TMA_ROWS, BLOCK_D]
            )
        if V_KEYS_MAJOR:
            v_desc = tl.make_tensor_descriptor(
                v_ptr,
                [pool_rows // BLOCK_SIZE * row, BLOCK_SIZE],
                [stride_v_dim, 1],
                [BLOCK_D, BLOCK_N],
            )
        else:
            v_desc = tl.make_tensor_descriptor(
                v_ptr, [pool_rows, row], [stride_v_slot, 1], [TMA_ROWS, BLOCK_D]
            )
        descs = (k_desc, v_desc, kv_head * HEAD_DIM, row)
        if QUANTIZED:
            # The keys-major scale pools (the launcher checked) as one run of (block, KV head,
            # slot) scales: a tile's scales are one descriptor load of BLOCK_N contiguous ones.
            scales_end = pool_rows // BLOCK_SIZE
            k_scale_desc = tl.make_tensor_descriptor(
                k_scale_ptr, [scales_end * stride_ks_block], [1], [BLOCK_N]
            )
            if K8V8 or K8V16:  # no V scale per key
                descs += (k_scale_desc, 0, kv_head * stride_ks_head, 0)
            else:
                descs += (
                    k_scale_desc,
                    tl.make_tensor_descriptor(
                        v_scale_ptr, [scales_end * stride_vs_block], [1], [BLOCK_N]
                    ),
                    kv_head * stride_ks_head,
                    kv_head * stride_vs_head,
                )
    else:
        descs = (0, 0, 0, 0)

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
            acc, row_max, row_sum = _attend_run(
                (acc, row_max, row_sum),
                q,
                caches,
                descs,
                table,
                run_lo,
                run_hi,
                full_end,
                key_limit,
                scale_log2,
                p_unit,
                BLOCK_N,
                BLOCK_D,
                HEAD_DIM,
                BLOCK_SIZE,
                PIECES,
                KV_PATH,
                SAME_KV_STRIDES,
                OFFSETS_32,
                UPCAST,
                DOT_PRECISION,
                QUANTIZED,
                V_KEYS_MAJOR,
                SCALES_KEYS_MAJOR,
                WIDE_SCALES,
                K8V8,
                V_BLOCK_SCALES,
                K8V16,
                PV_DTYPE,
                INTERPRETED,
                TMA,
                SCORES_AHEAD,
                SCORE_BITS,
            )
            # Skip the union of the gaps that cover run_hi.
            for _ in tl.static_range(GAPS):
                covering = (gap_lo <= run_hi) & (gap_hi > run_hi)
                run_hi = tl.max(tl.where(covering, gap_hi, run_hi), axis=0)
            run_lo = run_hi
    else:
        acc, row_max, row_sum = _attend_run(
            (acc, row_max, row_sum),
            q,
            caches,
            descs,
            table,
            k_len * 0,
            keys_end,
            full_end,
            key_limit,
            scale_log2,
            p_unit,
            BLOCK_N,
            BLOCK_D,
            HEAD_DIM,
            BLOCK_SIZE,
            PIECES,
            KV_PATH,
            SAME_KV_STRIDES,
            OFFSETS_32,
            UPCAST,
            DOT_PRECISION,
            QUANTIZED,
            V_KEYS_MAJOR,
            SCALES_KEYS_MAJOR,
            WIDE_SCALES,
            K8V8,
            V_BLOCK_SCALES,
            K8V16,
            PV_DTYPE,
            INTERPRETED,
            TMA,
            SCORES_AHEAD,
            SCORE_BITS,
        )

    # A query with no visible key outputs zeros, as FlashAttention does.
    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    if K8V8 and not V_BLOCK_SCALES:
        # A frozen V scale per (KV head, channel): applied once, here.
        v_channels = tl.load(
            v_scale_ptr + kv_head * stride_vs_head + offs_d * stride_vs_slot,
            mask=d_mask,
            other=0.0,
        )
        out = out * v_channels[None, :]
    elif QUANTIZED:
        out = out * p_unit  # after the division: acc * p_unit alone may overflow
    if HAS_V_EQUALIZER:
        # V was stored divided by these factors.
        v_factor = tl.load(
            v_equalizer_ptr + kv_head * stride_veq_head + offs_d * stride_veq_dim,
            mask=d_mask,
            other=1.0,
        )
        out = out * v_factor[None, :]
    # The output's rows from the sequence's scalar start and the rows' own offsets, not from
    # q_rows: a per-row sum live across the key loops pushed the quantized kernels' registers
    # over the limit (Triton 3.6 spilled 4-24 bytes a launch at blocks 24, 520 and 1560). The
    # rows themselves are computed again here (_tile_index_again).
    query, head, m_mask = _program_rows(
        _tile_index_again(INTERPRETED), kv_head, q_len, BLOCK_M, GROUP
    )
    io_mask = m_mask[:, None] & d_mask[None, :]
    out_rows = query.to(tl.int64) * stride_o_tok + head.to(tl.int64) * stride_o_head
    tl.store(
        out_ptr
        + q_start.to(tl.int64) * stride_o_tok
        + out_rows[:, None]
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
        if K8V8:
            lse -= LOG2_E4M3_MAX * LN2  # its row sums are of probabilities 448 times larger
        lse_rows = query.to(tl.int64) * stride_lse_tok + head.to(tl.int64) * stride_lse_head
        tl.store(
            lse_ptr + q_start.to(tl.int64) * stride_lse_tok + lse_rows,
            lse,
            mask=m_mask,
        )
