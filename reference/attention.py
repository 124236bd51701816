"""Float64 attention oracles: dense attention over explicit K/V, and paged attention by gathering.

These are deliberately naive: a loop over sequences, an explicit boolean mask, a float64
softmax. Every kernel in ``kernels/`` is checked against them.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

from paged_video.reference.quantize import dequantize


def attention_mask(
    q_len: int,
    k_len: int,
    *,
    causal: bool = False,
    key_limits: Tensor | None = None,
    key_gap: list[tuple[int, int]] | tuple[int, int] | None = None,
    device: torch.device | str = "cpu",
) -> Tensor:
    """Boolean ``(q_len, k_len)`` mask, True where query i may attend key j.

    ``causal`` is FlashAttention's bottom-right alignment: query i sees keys
    ``j <= i + k_len - q_len``. ``key_limits`` (``(q_len,)``) is an exclusive upper bound on the
    keys each query sees. ``key_gap = (lo, hi)``, or a list of such pairs, hides keys
    ``lo <= j < hi`` from every query.
    """
    rows = torch.arange(q_len, device=device)[:, None]
    cols = torch.arange(k_len, device=device)[None, :]
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        mask &= cols <= rows + (k_len - q_len)
    if key_limits is not None:
        mask &= cols < key_limits.to(device=device, dtype=torch.int64)[:, None]
    if key_gap is not None:
        gaps = [key_gap] if isinstance(key_gap[0], int) else key_gap
        for lo, hi in gaps:
            mask &= (cols < lo) | (cols >= hi)
    return mask


def dense_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    mask: Tensor | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Float64 attention of one sequence: ``q (Lq, H, D)`` over ``k, v (Lk, Hkv, D)``.

    GQA when ``H`` is a multiple of ``Hkv``. ``mask`` is an optional boolean ``(Lq, Lk)`` mask
    (True = attend), combined with ``causal`` (bottom-right). A query that may attend no key
    gets zeros, as FlashAttention returns. The result is float64 ``(Lq, H, D)``; with
    ``return_lse`` also the float64 ``(Lq, H)`` natural-log sum of ``exp`` of each query's
    visible scaled scores (``-inf`` when it sees no key).
    """
    q_len, num_heads, head_dim = q.shape
    k_len, num_kv_heads, _ = k.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    group = num_heads // num_kv_heads
    q64 = q.to(torch.float64).transpose(0, 1)  # (H, Lq, D)
    k64 = k.to(torch.float64).repeat_interleave(group, dim=1).transpose(0, 1)
    v64 = v.to(torch.float64).repeat_interleave(group, dim=1).transpose(0, 1)
    allowed = attention_mask(q_len, k_len, causal=causal, device=q.device)
    if mask is not None:
        allowed = allowed & mask.to(q.device)
    scores = torch.matmul(q64, k64.transpose(1, 2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # softmax of an all -inf row is NaN; such a query sees nothing and its output is zero.
    probs = torch.where(allowed.any(dim=-1, keepdim=True), probs, torch.zeros_like(probs))
    out = torch.matmul(probs, v64).transpose(0, 1).contiguous()
    if not return_lse:
        return out
    # logsumexp of a row of -inf (or of no keys) is -inf.
    return out, torch.logsumexp(scores, dim=-1).transpose(0, 1).contiguous()


def gather_sequence(cache: Tensor, block_table_row: Tensor, length: int) -> Tensor:
    """Keys (or values) ``0 .. length-1`` of one sequence, gathered through its block table."""
    block_size = cache.shape[1]
    positions = torch.arange(length, device=cache.device)
    blocks = block_table_row.to(cache.device, torch.int64)[positions // block_size]
    return cache[blocks, positions % block_size]


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
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The kernel's signature, computed by a loop over sequences in float64.

    Returns a tensor in ``q``'s dtype (written into ``out`` when given). ``max_seqlen_q`` is
    accepted for signature parity and only checked. Quantized caches come with ``k_scale`` /
    ``v_scale`` (``cache.shape[:-1]``): the codes are dequantized in float64 first, so a kernel
    reading the same codes is held to the float32 tolerance, quantization error aside.
    ``return_lse`` also returns the float64 ``(total_q, H)`` log-sum-exp of each row's visible
    scaled scores (``-inf`` for a row that sees no key).
    """
    result = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64, device=q.device)
    starts = cu_seqlens_q.tolist()
    lengths_k = seq_lens_k.tolist()
    if max(b - a for a, b in itertools.pairwise(starts)) > max_seqlen_q:
        raise ValueError("max_seqlen_q is smaller than the longest query sequence")
    for i, k_len in enumerate(lengths_k):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        keys = gather_sequence(k_cache, block_table[i], k_len)
        values = gather_sequence(v_cache, block_table[i], k_len)
        if k_scale is not None:
            keys = dequantize(keys, gather_sequence(k_scale, block_table[i], k_len))
        if v_scale is not None:
            values = dequantize(values, gather_sequence(v_scale, block_table[i], k_len))
        mask = attention_mask(
            hi - lo,
            k_len,
            key_limits=None if key_limits is None else key_limits[lo:hi],
            key_gap=None if key_gap is None else key_gap[i].reshape(-1, 2).tolist(),
            device=q.device,
        )
        result[lo:hi], lse[lo:hi] = dense_attention(
            q[lo:hi],
            keys,
            values,
            softmax_scale=softmax_scale,
            causal=causal,
            mask=mask,
            return_lse=True,
        )
    if out is None:
        out = result.to(q.dtype)
    else:
        out.copy_(result)
    return (out, lse) if return_lse else out
