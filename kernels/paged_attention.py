"""Varlen, non-causal (optionally causal) attention of packed queries over a paged K/V cache.

Any block size >= 1. Key position ``p`` of sequence ``i`` lives in block
``block_table[i, p // block_size]`` at offset ``p % block_size``. Two ways of finding key rows:

* contiguous path, when the key tile divides the block size: a tile never crosses a block edge,
  so one table read gives the block and the tile's rows are consecutive slots;
* general path, any block size: the block is looked up per key row.

Online softmax in float32 (exp2 with the scale folded in), output in ``q``'s dtype.
"""

from __future__ import annotations

import itertools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import _checks, torch_path
from kernels._runtime import interpreter_active, use_torch_path

LOG2E = 1.4426950408889634


@triton.heuristics(
    {
        "HAS_KEY_LIMITS": lambda args: args["key_limits_ptr"] is not None,
        "HAS_KEY_GAP": lambda args: args["key_gap_ptr"] is not None,
    }
)
@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_table_ptr,
    cu_seqlens_q_ptr,
    seq_lens_k_ptr,
    key_limits_ptr,
    key_gap_ptr,
    scale_log2,
    heads_per_kv_head,
    head_dim,
    block_size,
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
    gaps_per_row,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    CONTIGUOUS_TILES: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_KEY_LIMITS: tl.constexpr,
    HAS_KEY_GAP: tl.constexpr,
    GAPS: tl.constexpr,
):
    tile_m = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile_m * BLOCK_M >= q_len:
        return
    k_len = tl.load(seq_lens_k_ptr + seq)
    kv_head = head // heads_per_kv_head

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < head_dim
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr
        + q_rows[:, None] * stride_q_tok
        + head * stride_q_head
        + offs_d[None, :] * stride_q_dim,
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # Exclusive upper bound on the keys each query row sees; rows past q_len see nothing.
    key_limit = tl.zeros([BLOCK_M], dtype=tl.int32) + k_len
    if CAUSAL:
        key_limit = tl.minimum(key_limit, offs_m + (k_len - q_len) + 1)
    if HAS_KEY_LIMITS:
        row_limits = tl.load(key_limits_ptr + q_start + offs_m, mask=m_mask, other=0)
        key_limit = tl.minimum(key_limit, row_limits)
    key_limit = tl.where(m_mask, key_limit, 0)
    keys_end = tl.max(key_limit, axis=0)
    if HAS_KEY_GAP:
        # Up to GAPS hidden ranges [lo, hi) per row; missing ones load as the empty [0, 0).
        offs_g = tl.arange(0, GAPS)
        g_mask = offs_g < gaps_per_row
        gap_row = key_gap_ptr + seq * 2 * gaps_per_row + 2 * offs_g
        gap_lo = tl.load(gap_row, mask=g_mask, other=0)
        gap_hi = tl.load(gap_row + 1, mask=g_mask, other=0)

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_table_row

    for n_start in range(0, keys_end, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < keys_end
        if HAS_KEY_GAP:
            # Hidden keys are never loaded: they may be unwritten slots holding NaN.
            in_gap = (offs_n[:, None] >= gap_lo[None, :]) & (offs_n[:, None] < gap_hi[None, :])
            n_mask = n_mask & (tl.max(in_gap.to(tl.int32), axis=1) == 0)
        if CONTIGUOUS_TILES:
            block = tl.load(table_row + (n_start // block_size) * stride_table_col)
            slot = (n_start % block_size) + tl.arange(0, BLOCK_N)
            block = block.to(tl.int64)
            k_rows = block * stride_k_block + slot.to(tl.int64) * stride_k_slot
            v_rows = block * stride_v_block + slot.to(tl.int64) * stride_v_slot
        else:
            # Masked lanes read no table entry: padding past the sequence is never touched.
            block = tl.load(
                table_row + (offs_n // block_size) * stride_table_col, mask=n_mask, other=0
            ).to(tl.int64)
            slot = (offs_n % block_size).to(tl.int64)
            k_rows = block * stride_k_block + slot * stride_k_slot
            v_rows = block * stride_v_block + slot * stride_v_slot
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr + k_rows[:, None] + kv_head * stride_k_head + offs_d[None, :] * stride_k_dim,
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_ptr + v_rows[:, None] + kv_head * stride_v_head + offs_d[None, :] * stride_v_dim,
            mask=kv_mask,
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = n_mask[None, :] & (offs_n[None, :] < key_limit[:, None])
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # A row that has seen no visible key yet keeps max -inf; subtract 0 instead of -inf
        # so exp2 gives 0, not NaN.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.math.exp2(scores - safe_max[:, None])
        rescale = tl.math.exp2(row_max - safe_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max

    # A query with no visible key outputs zeros, as FlashAttention does.
    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    tl.store(
        out_ptr
        + q_rows[:, None] * stride_o_tok
        + head * stride_o_head
        + offs_d[None, :] * stride_o_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def _is_tile(value: int) -> bool:
    return value >= 16 and value & (value - 1) == 0


def choose_tiles(
    *,
    block_size: int,
    head_dim: int,
    max_seqlen_q: int,
    dtype: torch.dtype,
    block_m: int | None = None,
    block_n: int | None = None,
) -> dict[str, int | bool]:
    """Tile sizes and launch settings for one call, with the caller's overrides applied.

    Under the interpreter every program is a batch of numpy ops, so big tiles are much faster.
    On a GPU the tiles are sized for registers and shared memory.
    """
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value is not None and (not isinstance(value, int) or not _is_tile(value)):
            raise ValueError(f"{name} must be a power of two >= 16, got {value!r}")
    short_q = max(16, triton.next_power_of_2(max(1, max_seqlen_q)))
    if interpreter_active():
        # 1024 x 512 scores stay under Triton's 2**20-element block limit.
        default_m, default_n, warps, stages = min(1024, short_q), 512, 4, 1
    elif head_dim > 128 or dtype == torch.float32:
        default_m, default_n, warps, stages = min(64, short_q), 32, 4, 2
    else:
        default_m, default_n = min(128, short_q), 64
        warps, stages = (8 if head_dim > 64 and default_m == 128 else 4), 3
    tile_m = block_m or default_m
    tile_n = block_n or default_n
    return {
        "BLOCK_M": tile_m,
        "BLOCK_N": tile_n,
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "CONTIGUOUS_TILES": block_size % tile_n == 0,
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
) -> None:
    _checks.check_rank("q", q, 3, "(total_q, num_heads, head_dim)")
    layout = "(num_blocks, block_size, num_kv_heads, head_dim)"
    _checks.check_rank("k_cache", k_cache, 4, layout)
    _checks.check_rank("v_cache", v_cache, 4, layout)
    _checks.check_rank("block_table", block_table, 2, "(batch, width)")
    _checks.check_rank("cu_seqlens_q", cu_seqlens_q, 1, "(batch + 1,)")
    _checks.check_rank("seq_lens_k", seq_lens_k, 1, "(batch,)")
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
    )
    _checks.check_dtype("q", q, _checks.FLOAT_DTYPES)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {cache.dtype}")
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
) -> Tensor:
    """Attention of packed queries ``q (total_q, H, D)`` over a paged cache.

    ``key_limits`` (int32 ``(total_q,)``) caps the keys each query sees (exclusive), e.g. for
    mixed causal/full masks; ``key_gap`` (int32 ``(batch, 2)`` or ``(batch, gaps, 2)``) hides
    keys ``lo <= j < hi`` of each row, e.g. the boundary tokens of an exact window, or the
    unwritten slots between a video run that ends mid-block and the action blocks.
    ``block_m``/``block_n`` override the tile. ``check_values=False`` skips the checks that
    read tensor values (no device sync).
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
    )
    _checks.check_softmax_scale(softmax_scale)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    # The kernel reads these as ptr + i (block_table's strides are passed).
    cu_seqlens_q, seq_lens_k, key_limits, key_gap = (
        _checks.contiguous_index(index) for index in (cu_seqlens_q, seq_lens_k, key_limits, key_gap)
    )
    head_dim = q.shape[2]
    if out is None:
        out = torch.empty_like(q)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    block_size = k_cache.shape[1]
    tiles = choose_tiles(
        block_size=block_size,
        head_dim=head_dim,
        max_seqlen_q=max_seqlen_q,
        dtype=q.dtype,
        block_m=block_m,
        block_n=block_n,
    )
    batch = block_table.shape[0]
    if batch == 0 or q.shape[0] == 0 or max_seqlen_q == 0:
        return out
    if use_torch_path(q):
        return torch_path.paged_attention(
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
        )
    upcast = interpreter_active() or q.dtype == torch.float32
    if key_gap is not None:
        key_gap = key_gap.reshape(batch, -1, 2).contiguous()
    gaps_per_row = 1 if key_gap is None else key_gap.shape[1]
    grid = lambda meta: (triton.cdiv(max_seqlen_q, meta["BLOCK_M"]), batch, q.shape[1])
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_table,
        cu_seqlens_q,
        seq_lens_k,
        key_limits,
        key_gap,
        scale * LOG2E,
        q.shape[1] // k_cache.shape[2],
        head_dim,
        block_size,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        *block_table.stride(),
        gaps_per_row,
        CAUSAL=causal,
        GAPS=max(1, triton.next_power_of_2(gaps_per_row)),
        UPCAST=upcast,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **tiles,
    )
    return out
