"""The warp-specialized key loop of ``paged_attention`` (``variant="ws"``): whole key tiles only.

A producer warp reads each tile's block id and issues the TMA loads of its K and V tiles into a
ring of buffers; two 4-warp consumer warpgroups run the MMAs and the online softmax
(``tl.range(..., warp_specialize=True)``). Triton partitions a kernel whose key loop is its only
loop and that has no early exit, so this kernel attends to the whole tiles of each sequence's
keys (``seq_lens_k // BLOCK_N`` of them, every row sees them all: no masks) and writes its
output and log-sum-exp; the launcher attends to the partial last tile with the masked kernel
and merges the two by their log-sum-exps. Tiles lie inside one block (the contiguous path), and
each pool is read as the 2-D tensor of (block, slot) rows and (KV head, channel) columns.
"""

from __future__ import annotations

import triton
import triton.language as tl

from paged_video.kernels._attention_jit import LN2


@triton.jit
def _paged_attention_ws_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    block_table_ptr,
    cu_seqlens_q_ptr,
    seq_lens_k_ptr,
    scale_log2,
    pool_rows,
    stride_q_tok,
    stride_k_slot,
    stride_v_slot,
    stride_o_tok,
    stride_o_head,
    stride_table_row,
    stride_table_col,
    stride_lse_tok,
    stride_lse_head,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Program (m, i, h): rows m*BLOCK_M.. of sequence i's queries at head h, over the
    sequence's whole key tiles. ``scale_log2 >= 0``; ``HEAD_DIM`` a power of two; one query
    head per KV head (a 3-D descriptor packing GQA heads fails Triton 3.6's partitioner); q's
    heads and channels packed."""
    tile_m = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    # No early exit (the partitioner cannot follow one): a program past the queries runs no tile.
    num_tiles = tl.where(tile_m * BLOCK_M < q_len, tl.load(seq_lens_k_ptr + seq), 0)
    num_tiles = num_tiles // BLOCK_N

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    # q through a descriptor too (the partitioner takes no pointer load feeding the loop), q
    # seen as (tokens, heads * HEAD_DIM). Rows past the sequence's queries read the next
    # sequence's (or zeros past the last): never stored.
    q_desc = tl.make_tensor_descriptor(
        q_ptr,
        [tl.load(cu_seqlens_q_ptr + tl.num_programs(1)), tl.num_programs(2) * HEAD_DIM],
        [stride_q_tok, 1],
        [BLOCK_M, HEAD_DIM],
    )
    q = q_desc.load([q_start + tile_m * BLOCK_M, kv_head * HEAD_DIM])
    row = tl.num_programs(2) * HEAD_DIM
    k_desc = tl.make_tensor_descriptor(
        k_ptr, [pool_rows, row], [stride_k_slot, 1], [BLOCK_N, HEAD_DIM]
    )
    v_desc = tl.make_tensor_descriptor(
        v_ptr, [pool_rows, row], [stride_v_slot, 1], [BLOCK_N, HEAD_DIM]
    )
    column = kv_head * HEAD_DIM
    table_row = block_table_ptr + seq.to(tl.int64) * stride_table_row

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for j in tl.range(0, num_tiles, warp_specialize=True):
        n_start = j * BLOCK_N
        block_id = tl.load(table_row + (n_start // BLOCK_SIZE) * stride_table_col)
        tile_row = block_id * BLOCK_SIZE + n_start % BLOCK_SIZE
        k = k_desc.load([tile_row, column])
        scores = tl.dot(q, k.T)
        # scale_log2 >= 0: the scaled row max is the row max scaled, each score one FFMA.
        new_max = tl.maximum(row_max, tl.max(scores, axis=1) * scale_log2)
        probs = tl.math.exp2(scores * scale_log2 - new_max[:, None])
        rescale = tl.math.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None]
        v = v_desc.load([tile_row, column])
        acc = tl.dot(probs.to(v.dtype), v, acc)
        row_max = new_max

    # A row that saw no tile: zeros and LSE -inf (the merge then weighs it 0).
    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    io_rows = q_rows[:, None] * stride_o_tok + kv_head.to(tl.int64) * stride_o_head
    tl.store(
        out_ptr + io_rows + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None],
    )
    lse = tl.where(
        row_sum > 0.0,
        (row_max + tl.math.log2(tl.where(row_sum > 0.0, row_sum, 1.0))) * LN2,
        float("-inf"),
    )
    tl.store(
        lse_ptr + q_rows * stride_lse_tok + kv_head.to(tl.int64) * stride_lse_head, lse, mask=m_mask
    )
