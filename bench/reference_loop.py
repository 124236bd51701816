"""Two flash-attention yardsticks for ``bench compile``, compiled, never launched.

``anchor_attention_kernel``: the plainest key loop, on contiguous K/V of one head with no block
table and no masks (the key count is a multiple of the key tile). Offsets inside a head are
int32 and the head's base is the one 64-bit address, so the loop spends on address math only
what any flash loop must. The report builds it with the tiles, warps and stages of each
``paged_attention`` launch and divides the two key loops.

The same kernel on e4m3 codes is the FP8 anchor: both products FP8 MMAs, V stored keys-major
(the layout the 8-bit MMA reads, through ``stride_v_dim``) and one scale for everything (the
probabilities in units of ``1 / P_UNIT``): what an FP8 flash loop costs before any per-key
scale. The report weighs the k8v8 launches against it.

``tutorial_attention_kernel``: the shape of Triton's fused-attention tutorial on Hopper: Q, K,
V and the output through tensor descriptors (TMA), the key loop warp-specialized (a producer
warp issuing the TMA loads, 4-warp consumers doing the MMAs and the softmax). The report builds
it once per head_dim and dtype, at its own settings (``TUTORIAL_LAUNCH``).
"""

from __future__ import annotations

import triton
import triton.language as tl

# The tutorial kernel's launch: 128 x 64 tiles; 4 warps, since with 8 Triton 3.9 silently
# builds the loop without warp specialization.
TUTORIAL_LAUNCH = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}


@triton.jit
def anchor_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    scale_log2,
    q_len,
    k_len,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_v_dim,
    stride_o_tok,
    stride_o_head,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    P_UNIT: tl.constexpr = 1.0,
):
    """One (query tile, head) per program; ``k_len`` is a multiple of ``BLOCK_N`` and every
    offset within a head fits in int32. ``BLOCK_D``: ``HEAD_DIM`` rounded up to a power of two
    (dimensions past ``HEAD_DIM`` are masked); ``scale_log2 >= 0``. ``stride_v_dim`` is 1 for
    16-bit V (specialized away), the key count for keys-major e4m3 V; ``P_UNIT``: the
    probabilities go to the ``P V`` MMA times it (448 for e4m3, one multiply each, as a
    per-tensor V scale would cost)."""
    tile_m = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d[None, :] < HEAD_DIM
    m_mask = offs_m[:, None] < q_len
    # The one 64-bit address per tensor; everything added to it is an int32 offset.
    q_head = q_ptr + head * stride_q_head
    k_head = k_ptr + head * stride_k_head
    v_head = v_ptr + head * stride_v_head
    o_head = out_ptr + head * stride_o_head
    q = tl.load(
        q_head + offs_m[:, None] * stride_q_tok + offs_d[None, :],
        mask=m_mask & d_mask,
        other=0.0,
    )
    # The tile's pointers are loop-invariant; a tile adds one int32 row offset to them.
    k_tile = k_head + offs_n[:, None] * stride_k_tok + offs_d[None, :]
    v_tile = v_head + offs_n[:, None] * stride_v_tok + offs_d[None, :] * stride_v_dim
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n_start in range(0, k_len, BLOCK_N):
        if HEAD_DIM == BLOCK_D:
            k = tl.load(k_tile + n_start * stride_k_tok)
            v = tl.load(v_tile + n_start * stride_v_tok)
        else:
            k = tl.load(k_tile + n_start * stride_k_tok, mask=d_mask, other=0.0)
            v = tl.load(v_tile + n_start * stride_v_tok, mask=d_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k))
        # scale_log2 >= 0: the scaled row max is the row max scaled, and each score is one FFMA.
        new_max = tl.maximum(row_max, tl.max(scores, axis=1) * scale_log2)
        probs = tl.math.exp2(scores * scale_log2 - new_max[:, None])
        rescale = tl.math.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        if P_UNIT != 1.0:
            probs = probs * P_UNIT
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v)
        row_max = new_max
    if P_UNIT != 1.0:
        row_sum = row_sum * P_UNIT
    out = acc / row_sum[:, None]
    tl.store(
        o_head + offs_m[:, None] * stride_o_tok + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask & d_mask,
    )


@triton.jit
def tutorial_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    scale_log2,
    q_len,
    k_len,
    heads,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """One (query tile, head) per program on contiguous ``(tokens, heads, HEAD_DIM)`` tensors;
    ``k_len`` is a multiple of ``BLOCK_N``, ``HEAD_DIM`` a power of two, ``scale_log2 >= 0``.

    The descriptors are made on the device: Triton may then split the query tile between two
    consumer warpgroups (a host-made descriptor's block shape is fixed, and the split fails).
    """
    row = heads * HEAD_DIM
    q_desc = tl.make_tensor_descriptor(q_ptr, [q_len, row], [row, 1], [BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(k_ptr, [k_len, row], [row, 1], [BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(v_ptr, [k_len, row], [row, 1], [BLOCK_N, HEAD_DIM])
    out_desc = tl.make_tensor_descriptor(out_ptr, [q_len, row], [row, 1], [BLOCK_M, HEAD_DIM])
    m_start = tl.program_id(0) * BLOCK_M
    column = tl.program_id(1) * HEAD_DIM
    q = q_desc.load([m_start, column])
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # warp_specialize: Triton moves the descriptor loads to a producer partition that fills the
    # K/V buffers ahead of the consumer warpgroups.
    for n_start in tl.range(0, k_len, BLOCK_N, warp_specialize=True):
        k = k_desc.load([n_start, column])
        scores = tl.dot(q, k.T)
        new_max = tl.maximum(row_max, tl.max(scores, axis=1) * scale_log2)
        probs = tl.math.exp2(scores * scale_log2 - new_max[:, None])
        rescale = tl.math.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None]
        v = v_desc.load([n_start, column])
        acc = tl.dot(probs.to(v.dtype), v, acc)
        row_max = new_max
    out = acc / row_sum[:, None]
    out_desc.store([m_start, column], out.to(out_ptr.dtype.element_ty))
