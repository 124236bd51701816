"""The k8v8 format's V: e4m3 codes with a float32 scale per (block, KV head, channel).

A value ``v`` of channel ``c`` in block ``b`` is stored as the e4m3 code of ``v / s[b, h, c]``
(nearest, ties to even, saturating at 448) and reads back as ``code * s[b, h, c]``. With the
scale on the channel, not on the key, the attention loop multiplies no probability by a scale:
``P V`` sums codes and the scale multiplies the sum (docs/quantization.md, "k8v8").

The scale tensor is shaped ``(num_blocks, num_kv_heads, head_dim)`` in both of its forms:

* **frozen** (block stride 0, ``frozen_channel_scales``): one scale per (layer, KV head,
  channel), chosen by the layer's first write from the rows it writes, times ``headroom`` (a
  later value up to ``headroom`` times the first write's largest is stored unsaturated), and
  never changed (a channel zero at the choice takes its head's largest scale; the CPU flag
  ``v_scale_chosen``, the K mean's one-owner rule). Attention
  applies it once, to the output.
* **per block**: a block's scales are chosen by the write that writes the block's first slot,
  from the rows it writes into that block, times ``headroom``; later writes into the block
  (a chunk that starts mid-block) use them. Attention applies them when a key tile's ``P V``
  is added into the float32 accumulator, so a key tile must lie inside one block.

A write whose value would exceed 448 codes (or is nonzero where the scale is 0) is stored
saturated and counted in ``v_saturated`` when the caller passes one (int32 ``(1,)`` on the
pools' device): never silently. So is a row lost whole, all its codes zero while it holds a
nonzero value (values far below the scales, e.g. 1e-6 of a frozen channel's first write): its
nonzero elements are counted.
"""

from __future__ import annotations

import torch
from torch import Tensor

from paged_video.kernels import _checks
from paged_video.kernels.quantize import E4M3_MAX, SCALE_DTYPE

# A frozen scale's room above the first write's largest value (issue 45's float64 sketch: 256
# keeps V growing 100x after the first write at 4.0% rel L1, 16 gave 46%).
V_HEADROOM = 256.0


def frozen_channel_scales(
    num_blocks: int, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu"
) -> Tensor:
    """A frozen scale tensor: ``(num_blocks, num_kv_heads, head_dim)`` float32 with block
    stride 0 over one ``(num_kv_heads, head_dim)`` storage, zeros until chosen."""
    shared = torch.zeros(1, num_kv_heads, head_dim, dtype=SCALE_DTYPE, device=device)
    return shared.expand(num_blocks, num_kv_heads, head_dim)


def is_frozen(scales: Tensor) -> bool:
    """True when the scale tensor holds one scale per (KV head, channel) for every block."""
    return scales.stride(0) == 0 or scales.shape[0] == 1


def check_format(
    k_pool: Tensor,
    v_pool: Tensor,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    v_equalizer: Tensor | None,
    v_channel_scale: Tensor,
    pool_names: tuple[str, str] = ("k_pool", "v_pool"),
) -> None:
    """The k8v8 pools beside ``v_channel_scale``, as a write and an attention take them: int8
    K with ``k_scale``, e4m3 V with its channel scales only (``pool_names``: the caller's
    names of the K and V pools)."""
    k_name, v_name = pool_names
    if k_pool.dtype != torch.int8 or v_pool.dtype != torch.float8_e4m3fn:
        raise TypeError(
            f"v_channel_scale (k8v8) needs an int8 {k_name} and a float8_e4m3fn {v_name}, got "
            f"{k_pool.dtype} and {v_pool.dtype}"
        )
    if k_scale is None:
        raise ValueError("v_channel_scale (k8v8) needs k_scale, K's scale per slot")
    if v_scale is not None or v_equalizer is not None:
        raise ValueError("v_channel_scale (k8v8) replaces v_scale and v_equalizer: pass neither")
    check_channel_scales("v_channel_scale", v_channel_scale, v_name, v_pool)


def check_channel_scales(name: str, scales: Tensor, pool_name: str, pool: Tensor) -> None:
    """``scales`` is float32 ``(num_blocks, num_kv_heads, head_dim)`` of the 4-D ``pool``."""
    _checks.check_tensor(name, scales)
    _checks.check_dtype(name, scales, (SCALE_DTYPE,))
    if pool.dim() != 4:
        raise ValueError(
            f"{name} needs {pool_name} paged (num_blocks, block_size, num_kv_heads, head_dim), "
            f"got shape {tuple(pool.shape)}"
        )
    want = (pool.shape[0], pool.shape[2], pool.shape[3])
    if tuple(scales.shape) != want:
        raise ValueError(
            f"{name} must have shape {want} ({pool_name}'s num_blocks, num_kv_heads, head_dim), "
            f"got {tuple(scales.shape)}"
        )
    if any(stride < 0 for stride in scales.stride()):
        raise ValueError(f"{name} must have non-negative strides, got {scales.stride()}")


def choose_frozen(scales: Tensor, value: Tensor, slot_mapping: Tensor, headroom: float) -> None:
    """Set the frozen ``scales`` from ``value``'s rows with a slot: per (KV head, channel) the
    largest finite magnitude times ``headroom`` / 448 (``_nonzero``). No device sync."""
    used = (slot_mapping >= 0)[:, None, None]
    values = value.to(SCALE_DTYPE).abs()
    values = torch.where(used & values.isfinite(), values, 0.0)
    amax = values.amax(dim=0) if values.shape[0] else values.new_zeros(values.shape[1:])
    scales[:1].copy_(_nonzero(amax * (headroom / E4M3_MAX))[None])


def _nonzero(scale: Tensor) -> Tensor:
    """``scale (..., head_dim)`` with a zero channel's scale its head's largest, and a head
    all zero 1 (``reference.eight_bit_attention``'s rule), so later values of a channel that
    was zero at the choice are stored."""
    head = scale.amax(dim=-1, keepdim=True)
    return torch.where(scale > 0, scale, torch.where(head > 0, head, 1.0))


def choose_per_block(
    scales: Tensor, value: Tensor, slot_mapping: Tensor, block_size: int, headroom: float
) -> None:
    """Set the scales of the blocks whose first slot this write writes, from the rows it writes
    into each (the largest finite magnitude per KV head and channel times ``headroom`` / 448,
    ``_nonzero``). No device sync."""
    slots = slot_mapping.long()
    used = slots >= 0
    blocks = torch.where(used, slots // block_size, 0)
    values = value.to(SCALE_DTYPE).abs()
    values = torch.where(used[:, None, None] & values.isfinite(), values, 0.0)
    amax = torch.zeros(scales.shape, dtype=SCALE_DTYPE, device=scales.device)
    index = blocks[:, None, None].expand_as(values)
    amax.scatter_reduce_(0, index, values, reduce="amax")
    firsts = (used & (slots % block_size == 0)).to(torch.int32)
    starts = torch.zeros(scales.shape[0], dtype=torch.int32, device=scales.device)
    starts = starts.index_add_(0, blocks, firsts) > 0
    chosen = _nonzero(amax * (headroom / E4M3_MAX))
    scales.copy_(torch.where(starts[:, None, None], chosen, scales))
