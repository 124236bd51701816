"""This project's kernels behind the call forms of vllm-omni's AR-Diffusion attention.

vllm-omni's ``ar_diffusion_paged_attention`` reaches its kernels three ways, and each has a
counterpart here with the same arguments and vllm-omni's semantics:

* ``reference_paged_attention``: the CPU seam (``_reference_paged_attention``);
* ``varlen_attention``: the two ``flash_attn_varlen_func`` call forms its CUDA path uses, the
  paged one (``block_table`` with ``seqused_k``) and the contiguous one (``cu_seqlens_k`` over
  K/V gathered into one buffer);
* ``stage_window``: the history staging of the contiguous form (``_stage_window``), through
  ``gather_blocks``.

``ar_attention`` is the CUDA branch of the entry point put together from them. Where the
semantics differ from vllm-omni's, it is on purpose and said: ``causal=True`` is computed (with
FlashAttention's bottom-right alignment, what vllm-omni's CUDA path asks FlashAttention for)
where vllm-omni's CPU reference refuses it, and a query whose dtype is not the caches' is
refused (``TypeError``) where that reference would compute in float32 and return the value
cache's dtype: with equal dtypes, as vllm-omni always calls it, the output dtype is the same.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from paged_video.kernels import gather_blocks, paged_attention


def _checks_values(tensor: Tensor) -> bool:
    """Check index values (a host sync) only on the CPU: on a GPU the call must stay
    sync-free, as FlashAttention's is, for CUDA-graph capture."""
    return tensor.device.type == "cpu"


def _check_same_dtype(query: Tensor, key: Tensor, value: Tensor) -> None:
    for name, tensor in (("key_cache", key), ("value_cache", value)):
        if tensor.dtype != query.dtype:
            raise TypeError(
                f"{name} dtype {tensor.dtype} must equal the query dtype {query.dtype}: "
                "this backend does not compute mixed-dtype attention"
            )


def reference_paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    softmax_scale: float,
    *,
    causal: bool,
) -> Tensor:
    """vllm-omni's CPU seam on ``paged_attention``: ``query (T, H, D)`` over the paged caches.

    Sequence ``i`` has queries ``query_start_loc[i]:query_start_loc[i + 1]`` and keys
    ``0 .. seq_lens[i] - 1`` through ``block_table[i]``. Output in the query's dtype.
    """
    _check_same_dtype(query, key_cache, value_cache)
    starts = query_start_loc.tolist()
    max_seqlen_q = max((end - start for start, end in itertools.pairwise(starts)), default=0)
    return paged_attention(
        query,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        max_seqlen_q=max_seqlen_q,
        softmax_scale=float(softmax_scale),
        causal=bool(causal),
        check_values=_checks_values(query),
    )


def varlen_attention(
    *,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    cu_seqlens_q: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    seqused_k: Tensor | None = None,
    block_table: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    kv_block_size: int | None = None,
) -> Tensor:
    """``flash_attn_varlen_func`` in the two forms vllm-omni calls it, written into ``out``.

    Paged: ``k``/``v`` are caches ``(num_blocks, block_size, Hkv, D)``, sequence ``i`` reads
    keys ``0 .. seqused_k[i] - 1`` through ``block_table[i]``. Contiguous: ``k``/``v`` are packed
    ``(rows, Hkv, D)`` and one sequence reads rows ``cu_seqlens_k[0] .. cu_seqlens_k[1] - 1``;
    the rows are read as blocks of ``kv_block_size`` (default: all rows as one block), so a
    buffer of whole cache blocks runs the same kernel as the paged form. ``max_seqlen_k`` is
    accepted for parity with FlashAttention and not needed.
    """
    del max_seqlen_k
    paged = block_table is not None or seqused_k is not None
    if paged == (cu_seqlens_k is not None):
        raise ValueError(
            "pass either block_table with seqused_k (paged form) or cu_seqlens_k (contiguous form)"
        )
    if paged:
        if block_table is None or seqused_k is None:
            raise ValueError("the paged form needs both block_table and seqused_k")
        return paged_attention(
            q,
            k,
            v,
            block_table,
            cu_seqlens_q,
            seqused_k,
            max_seqlen_q=max_seqlen_q,
            softmax_scale=float(softmax_scale),
            causal=bool(causal),
            out=out,
            check_values=_checks_values(q),
        )
    if cu_seqlens_k.dim() != 1 or cu_seqlens_k.shape[0] != 2:
        raise ValueError(
            "the contiguous form takes one sequence (cu_seqlens_k of shape (2,)), as vllm-omni's "
            f"gather path passes; got shape {tuple(cu_seqlens_k.shape)}"
        )
    for name, tensor in (("k", k), ("v", v)):
        if tensor.dim() != 3:
            raise ValueError(
                f"{name} must be packed (rows, num_kv_heads, head_dim) in the contiguous form, "
                f"got shape {tuple(tensor.shape)}"
            )
    rows = k.shape[0]
    block_size = rows if kv_block_size is None else kv_block_size
    if block_size < 1 or rows % block_size:
        raise ValueError(f"kv_block_size {kv_block_size} must divide the {rows} packed K/V rows")
    num_blocks = rows // block_size
    table = torch.arange(num_blocks, dtype=torch.int32, device=k.device).unsqueeze(0)
    # Keys before cu_seqlens_k[0] are hidden by a key gap, so no value is read on the host.
    seq_lens_k = cu_seqlens_k[1:].to(torch.int32)
    key_gap = torch.stack((torch.zeros_like(seq_lens_k), cu_seqlens_k[:1].to(torch.int32)), 1)
    return paged_attention(
        q,
        k.view(num_blocks, block_size, *k.shape[1:]),
        v.view(num_blocks, block_size, *v.shape[1:]),
        table,
        cu_seqlens_q,
        seq_lens_k,
        max_seqlen_q=max_seqlen_q,
        softmax_scale=float(softmax_scale),
        causal=bool(causal),
        out=out,
        key_gap=key_gap,
        check_values=_checks_values(q),
    )


def stage_window(
    stage_key: Tensor,
    stage_value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_ids: Tensor,
    n_blocks: int,
    block_size: int,
    *,
    first_block: int,
) -> None:
    """vllm-omni's ``_stage_window`` on ``gather_blocks``: entries ``first_block..`` of
    ``block_ids`` into rows ``first_block * block_size ..`` of the staging buffers.

    As in vllm-omni, the buffers hold exactly ``n_blocks`` blocks in the caches' dtype, and the
    rows of the blocks before ``first_block`` are left as they are.
    """
    rows = n_blocks * block_size
    for name, stage, cache in (
        ("stage_key", stage_key, key_cache),
        ("stage_value", stage_value, value_cache),
    ):
        if stage.shape[:1] != (rows,) or stage.dtype != cache.dtype:
            raise ValueError(
                f"{name} must hold {n_blocks} blocks of {block_size} rows in {cache.dtype}, got "
                f"shape {tuple(stage.shape)} {stage.dtype}"
            )
    if block_ids.shape != (n_blocks,) or key_cache.shape[1] != block_size:
        raise ValueError(
            f"block_ids must have shape ({n_blocks},) over blocks of {block_size}, got "
            f"{tuple(block_ids.shape)} over blocks of {key_cache.shape[1]}"
        )
    gather_blocks(
        key_cache,
        value_cache,
        block_ids,
        stage_key,
        stage_value,
        first_block=first_block,
        check_values=_checks_values(key_cache),
    )


def ar_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
    softmax_scale: float,
    causal: bool,
    gather: bool,
    stage_key: Tensor | None,
    stage_value: Tensor | None,
    reuse_history: bool,
    current_tokens: int,
    stage_first_block: int,
) -> Tensor:
    """The CUDA branch of vllm-omni's ``ar_diffusion_paged_attention`` for ``query (T, H, D)``.

    ``gather`` (vllm-omni's contiguous K/V gather switch, one sequence): the visible blocks are
    staged into ``stage_key``/``stage_value`` (only from ``stage_first_block`` on when
    ``reuse_history``) or into fresh buffers, then attended as contiguous K/V. Otherwise the
    paged form reads the caches through ``block_table``. vllm-omni's own refusals are kept,
    with its messages.
    """
    out = torch.empty_like(query)
    if not gather:
        return varlen_attention(
            q=query,
            k=key_cache,
            v=value_cache,
            out=out,
            cu_seqlens_q=query_start_loc,
            max_seqlen_q=max_query_len,
            seqused_k=seq_lens,
            max_seqlen_k=max_seq_len,
            softmax_scale=softmax_scale,
            causal=causal,
            block_table=block_table,
        )
    block_size = key_cache.shape[1]
    n_blocks = max_seq_len // block_size
    if n_blocks * block_size != max_seq_len:
        raise ValueError("the contiguous K/V gather path requires max_seq_len to be block-aligned")
    block_ids = block_table[0, :n_blocks].to(torch.long)
    if stage_key is None or stage_value is None:
        k_flat = key_cache.new_empty((max_seq_len, *key_cache.shape[2:]))
        v_flat = value_cache.new_empty((max_seq_len, *value_cache.shape[2:]))
        first_block = 0
    else:
        k_flat, v_flat = stage_key[:max_seq_len], stage_value[:max_seq_len]
        first_block = stage_first_block if reuse_history else 0
        if reuse_history:
            # vllm-omni's refusals, as AssertionError with its messages (raised, not asserted,
            # so they hold under python -O too).
            current_blocks = current_tokens // block_size
            if current_tokens <= 0 or current_blocks * block_size != current_tokens:
                raise AssertionError(
                    f"staged reuse needs a block-aligned current chunk, got {current_tokens} tokens"
                )
            if stage_first_block < 0 or stage_first_block + current_blocks > n_blocks:
                raise AssertionError(
                    f"stage_first_block={stage_first_block} + {current_blocks} blocks "
                    f"exceeds the {n_blocks}-block window"
                )
    stage_window(
        k_flat,
        v_flat,
        key_cache,
        value_cache,
        block_ids,
        n_blocks,
        block_size,
        first_block=first_block,
    )
    # One sequence over the staged rows, as vllm-omni builds cu_seqlens_k: [0, kv_len].
    cu_seqlens_k = torch.cat((seq_lens.new_zeros(1), seq_lens.to(torch.int32)))
    return varlen_attention(
        q=query,
        k=k_flat,
        v=v_flat,
        out=out,
        cu_seqlens_q=query_start_loc,
        max_seqlen_q=max_query_len,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_k=max_seq_len,
        softmax_scale=softmax_scale,
        causal=causal,
        kv_block_size=block_size,
    )
