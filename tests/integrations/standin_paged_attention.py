"""A stand-in for vllm-omni 0.30.0's ``kv_cache/paged_attention.py`` seam, for tests without it.

Same attribute names, signatures and dispatch: the entry point flattens a batched query, calls
the module attribute ``_reference_paged_attention`` on a CPU, and on CUDA imports
``vllm.vllm_flash_attn.flash_attn_varlen_func`` at call time, in the paged form or (with
``VLLM_OMNI_AR_DIFFUSION_KV_GATHER=1`` and one sequence) the contiguous form after
``_stage_window``. The fused op's body writes the current K/V into the flat pools and calls the
entry point through this module's globals. Written for these tests; it is not vllm-omni's code.
"""

from __future__ import annotations

import os

import torch


def contiguous_kv_gather_enabled() -> bool:
    return os.environ.get("VLLM_OMNI_AR_DIFFUSION_KV_GATHER", "0") == "1"


def _reference_paged_attention(
    query, key_cache, value_cache, block_table, query_start_loc, seq_lens, softmax_scale, *, causal
):
    if causal:
        raise NotImplementedError("the AR-Diffusion reference attends non-causally")
    block_size = key_cache.shape[1]
    parts = []
    for row in range(seq_lens.shape[0]):
        lo, hi = int(query_start_loc[row]), int(query_start_loc[row + 1])
        positions = torch.arange(int(seq_lens[row]))
        blocks = block_table[row, positions // block_size].long()
        keys = key_cache[blocks, positions % block_size]
        values = value_cache[blocks, positions % block_size]
        scores = torch.einsum("qhd,khd->hqk", query[lo:hi].float(), keys.float())
        probs = torch.softmax(scores * float(softmax_scale), dim=-1).to(values.dtype)
        parts.append(torch.einsum("hqk,khd->qhd", probs, values))
    return torch.cat(parts)


def _stage_window(
    stage_key, stage_value, key_cache, value_cache, block_ids, n_blocks, block_size, *, first_block
):
    for stage, cache in ((stage_key, key_cache), (stage_value, value_cache)):
        blocks = stage.view(n_blocks, block_size, *cache.shape[2:])
        blocks[first_block:] = cache.index_select(0, block_ids[first_block:])


def ar_diffusion_paged_attention(
    query,
    key_cache,
    value_cache,
    *,
    block_table,
    query_start_loc,
    seq_lens,
    max_query_len,
    max_seq_len,
    softmax_scale,
    causal=False,
    stage_key=None,
    stage_value=None,
    reuse_history=False,
    current_tokens=0,
    stage_first_block=0,
):
    flat = query.reshape(-1, *query.shape[-2:])
    if not flat.is_cuda:
        out = _reference_paged_attention(
            flat,
            key_cache,
            value_cache,
            block_table,
            query_start_loc,
            seq_lens,
            softmax_scale,
            causal=causal,
        )
        return out.reshape(query.shape)
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    out = torch.empty_like(flat)
    if contiguous_kv_gather_enabled() and block_table.shape[0] == 1:
        block_size = key_cache.shape[1]
        n_blocks = max_seq_len // block_size
        block_ids = block_table[0, :n_blocks].long()
        k_flat, v_flat = stage_key[:max_seq_len], stage_value[:max_seq_len]
        first = stage_first_block if reuse_history else 0
        _stage_window(
            k_flat,
            v_flat,
            key_cache,
            value_cache,
            block_ids,
            n_blocks,
            block_size,
            first_block=first,
        )
        cu_seqlens_k = torch.cat((seq_lens.new_zeros(1), seq_lens))
        flash_attn_varlen_func(
            q=flat,
            k=k_flat,
            v=v_flat,
            out=out,
            cu_seqlens_q=query_start_loc,
            max_seqlen_q=max_query_len,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_k=max_seq_len,
            softmax_scale=softmax_scale,
            causal=causal,
        )
    else:
        flash_attn_varlen_func(
            q=flat,
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
    return out.reshape(query.shape)


def _paged_write_attn_impl(
    query,
    k_curr,
    v_curr,
    k_act,
    v_act,
    key_pool,
    value_pool,
    block_size,
    video_slots,
    action_slots,
    block_table,
    query_start_loc,
    seq_lens,
    max_query_len,
    max_seq_len,
    softmax_scale,
    stage_key=None,
    stage_value=None,
    reuse_history=False,
    stage_first_block=0,
):
    key_pool[video_slots] = k_curr.to(key_pool.dtype)
    value_pool[video_slots] = v_curr.to(value_pool.dtype)
    if k_act is not None and k_act.shape[0] > 0:
        key_pool[action_slots] = k_act.to(key_pool.dtype)
        value_pool[action_slots] = v_act.to(value_pool.dtype)
    return ar_diffusion_paged_attention(
        query,
        key_pool.unflatten(0, (-1, block_size)),
        value_pool.unflatten(0, (-1, block_size)),
        block_table=block_table,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        softmax_scale=softmax_scale,
        causal=False,
        stage_key=stage_key,
        stage_value=stage_value,
        reuse_history=reuse_history,
        current_tokens=int(k_curr.shape[0]),
        stage_first_block=stage_first_block,
    )
