"""The dense oracle of an autoregressive Wan rollout: plain per-layer K/V lists, dense attention.

The same diffusers ``WanTransformer3DModel`` (passed in; this module imports neither diffusers
nor anything of this project outside ``reference``) generates a video block by block: per block
a denoising forward per sigma that reads the history, then a forward at timestep 0 on the clean
block whose K/V are appended to a plain per-layer, per-branch tensor of every committed token.
Self-attention is dense float64 (by default) over exactly the model positions the window keeps
(``reference.window.kept_positions``) or, given ``read_block_size``, the positions whole-block
reads cover (``block_read_positions``: the boundary tokens a non-exact paged cache also reads),
plus the block's own tokens and its action keys. The rotary embedding of a block is the stock
``model.rope`` over all frames up to the block's end, keeping the block's own rows.

Given ``kv_dtype`` (``float8_e4m3fn`` or ``int8``), every key and value attention reads (history,
the block's own, actions) is what a quantized cache reads back: ``reference.quantize`` codes
times their per-(token, head) scale, in float64. With ``smooth_keys``, keys are quantized minus
the cache's smoothing mean: per layer and head, the mean of the keys of the video tokens (every
row) of the first forward to reach that layer, frozen for the rollout. Attention does not add it
back: it shifts each query's scores by the same amount. With ``equalize_channels`` (by default
for int8), each layer's K (minus its mean) and V are divided per (head, channel) by the factors
``reference.quantize.channel_factors`` chooses from that same first forward, quantized, and
multiplied back: what attention over the equalized pools computes in exact arithmetic. Those
factors stay frozen here: a later forward whose rows would regrow the cache's
(``reference.regrow``: a write of 64 rows or more with a channel 4x its factor) raises
``NotImplementedError`` rather than differ from the cache (the tiny rollouts never do).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch
from torch import Tensor

from paged_video.reference.quantize import K_SHARE, channel_factors, dequantize, quantize
from paged_video.reference.regrow import grow
from paged_video.reference.window import WindowGeometry, block_read_positions, kept_positions


@dataclass(frozen=True)
class ReferenceRead:
    """One forward of the reference rollout: the model positions its video keys were."""

    block: int
    step: int
    commit: bool
    positions: list[int]


@dataclass(frozen=True)
class ReferenceRolloutResult:
    """The latents, one ``ReferenceRead`` per forward per block, and with ``kv_dtype`` and
    ``smooth_keys`` the smoothing mean of each layer (``(heads, head_dim)`` float32); with
    channel equalization each layer's K and V factors (the same shape)."""

    latents: Tensor
    reads: list[list[ReferenceRead]]
    key_means: list[Tensor] | None = None
    equalizers: list[tuple[Tensor, Tensor]] | None = None


class _DenseHistory:
    """Per layer, per branch: the K and V of every committed token, in model position order."""

    def __init__(
        self,
        layers: int,
        rows: int,
        kv_dtype: torch.dtype | None,
        smooth_keys: bool,
        equalize: bool = False,
    ) -> None:
        self.keys: list[list[Tensor | None]] = [[None] * rows for _ in range(layers)]
        self.values: list[list[Tensor | None]] = [[None] * rows for _ in range(layers)]
        self.kv_dtype = kv_dtype
        self.smooth_keys = smooth_keys
        self.key_means: list[Tensor | None] = [None] * layers
        self.equalize = equalize
        self.equalizers: list[tuple[Tensor, Tensor] | None] = [None] * layers
        # Set by the driver for each forward.
        self.read: Tensor = torch.empty(0, dtype=torch.int64)
        self.rotary: tuple[Tensor, Tensor] | None = None
        self.actions: Tensor | None = None
        self.commit = False
        self.dtype = torch.float64

    def choose(self, layer: int, key: Tensor, value: Tensor) -> None:
        """At the first write to ``layer`` (quantized): with smoothing, the mean of its video keys
        ``(rows, tokens, heads, head_dim)`` over rows and tokens, float32 as the cache keeps it;
        with equalization, the K factors (keys minus that mean) and the V factors. A later write
        whose rows would regrow the cache's factors raises ``NotImplementedError``."""
        if self.kv_dtype is None:
            return
        if self.smooth_keys and self.key_means[layer] is None:
            self.key_means[layer] = key.to(torch.float64).mean(dim=(0, 1)).to(torch.float32)
        if not self.equalize:
            return
        mean = self.key_means[layer] if self.smooth_keys else None
        chosen = (
            channel_factors(key.flatten(0, 1), smooth=mean, share=K_SHARE),
            channel_factors(value.flatten(0, 1)),
        )
        if self.equalizers[layer] is None:
            self.equalizers[layer] = chosen
            return
        for name, frozen, candidate in zip("KV", self.equalizers[layer], chosen, strict=True):
            if grow(frozen, candidate, rows=key.shape[0] * key.shape[1])[1].any():
                raise NotImplementedError(
                    f"layer {layer}: this forward's rows would regrow the cache's {name} "
                    "equalization factors (reference.regrow), which this oracle does not model"
                )

    def stored(self, layer: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """``(..., heads, head_dim)`` K and V as the cache reads them back (unchanged unless
        ``kv_dtype``: dequantized codes, K minus the layer's smoothing mean, in float64)."""
        if self.kv_dtype is None:
            return key, value
        mean = self.key_means[layer] if self.smooth_keys else None
        k_factor, v_factor = self.equalizers[layer] if self.equalize else (None, None)
        keys = dequantize(*quantize(key, self.kv_dtype, smooth=mean, factor=k_factor))
        values = dequantize(*quantize(value, self.kv_dtype, factor=v_factor))
        if self.equalize:
            keys, values = keys * k_factor, values * v_factor
        return keys, values

    def append(self, layer: int, row: int, key: Tensor, value: Tensor) -> None:
        old_k, old_v = self.keys[layer][row], self.values[layer][row]
        self.keys[layer][row] = key if old_k is None else torch.cat([old_k, key])
        self.values[layer][row] = value if old_v is None else torch.cat([old_v, value])


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Interleaved-pair rotary embedding, as diffusers' Wan processor applies it."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).type_as(x)


def _qkv(attn: torch.nn.Module, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    heads = attn.heads
    query = attn.norm_q(attn.to_q(hidden)).unflatten(-1, (heads, -1))
    key = attn.norm_k(attn.to_k(hidden)).unflatten(-1, (heads, -1))
    return query, key, attn.to_v(hidden).unflatten(-1, (heads, -1))


def _dense(query: Tensor, key: Tensor, value: Tensor, dtype: torch.dtype) -> Tensor:
    """Non-causal attention of ``(q, H, D)`` over ``(k, H, D)`` in ``dtype``."""
    q, k, v = query.to(dtype), key.to(dtype), value.to(dtype)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(query.dtype)


class ReferenceWanSelfAttention:
    """A diffusers attention processor for Wan self-attention over a ``_DenseHistory``."""

    def __init__(self, history: _DenseHistory, layer: int) -> None:
        self.history = history
        self.layer = layer

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None
    ) -> Tensor:
        history, layer = self.history, self.layer
        query, key, value = _qkv(attn, hidden_states)
        query = _rotate(query, *history.rotary)
        key = _rotate(key, *history.rotary)
        history.choose(layer, key, value)
        key, value = history.stored(layer, key, value)
        if history.actions is not None:
            _, action_key, action_value = _qkv(attn, history.actions.to(hidden_states.dtype))
            action_key, action_value = history.stored(layer, action_key, action_value)
        outs = []
        for row in range(hidden_states.shape[0]):
            keys, values = [key[row]], [value[row]]
            if history.read.numel():
                keys.insert(0, history.keys[layer][row][history.read])
                values.insert(0, history.values[layer][row][history.read])
            if history.actions is not None:
                keys.append(action_key[row])
                values.append(action_value[row])
            outs.append(_dense(query[row], torch.cat(keys), torch.cat(values), history.dtype))
            if history.commit:
                history.append(layer, row, key[row], value[row])
        out = torch.stack(outs).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))


@torch.no_grad()
def reference_rollout(
    model: torch.nn.Module,
    noise: Tensor,
    prompt_embeds: Tensor,
    negative_prompt_embeds: Tensor | None = None,
    *,
    frames_per_block: int,
    sink_frames: int,
    window_frames: int,
    sigmas: SequenceOf[float] = (1.0, 0.75, 0.5, 0.25),
    guidance_scale: float = 5.0,
    reset_at_boundary: bool = False,
    read_block_size: int | None = None,
    actions: Tensor | None = None,
    dtype: torch.dtype = torch.float64,
    kv_dtype: torch.dtype | None = None,
    smooth_keys: bool = True,
    equalize_channels: bool | None = None,
) -> ReferenceRolloutResult:
    """Generate like ``models.wan_paged.PagedWanRollout.generate``, densely.

    Frames are patched latent frames (the window's chunks). ``read_block_size=None`` reads
    exactly the kept frames; an int ``B`` reads every token in a ``B``-token block that holds a
    kept token (the positions a paged cache with blocks of ``B`` reads without ``exact_window``).
    ``kv_dtype`` / ``smooth_keys`` / ``equalize_channels``: attention reads K/V as a cache with
    ``PagingConfig(kv_dtype=..., smooth_keys=..., equalize_channels=...)`` stores them (the
    module docstring says how; ``equalize_channels=None`` equalizes int8 only, as the cache).
    The model's self-attention processors are swapped for the duration and put back.
    """
    if kv_dtype is not None and kv_dtype not in (torch.float8_e4m3fn, torch.int8):
        raise ValueError(f"kv_dtype must be None, float8_e4m3fn or int8, got {kv_dtype}")
    p_t, p_h, p_w = model.config.patch_size
    _, _, total, height, width = noise.shape
    frames = frames_per_block // p_t
    chunk = (height // p_h) * (width // p_w)
    n = frames * chunk
    geometry = WindowGeometry(
        chunk_size=chunk,
        block_size=read_block_size or 1,
        sink_chunks=sink_frames,
        window_chunks=window_frames,
        reset_at_boundary=reset_at_boundary,
    )
    reads_of = kept_positions if read_block_size is None else block_read_positions
    text = prompt_embeds
    if negative_prompt_embeds is not None:
        text = torch.cat([prompt_embeds, negative_prompt_embeds])
    rows = text.shape[0]
    if equalize_channels is None:
        equalize_channels = kv_dtype == torch.int8
    equalize = kv_dtype is not None and equalize_channels
    history = _DenseHistory(len(model.blocks), rows, kv_dtype, smooth_keys, equalize)
    history.dtype = dtype
    attention = [block.attn1 for block in model.blocks]
    stock = [attn.processor for attn in attention]
    for layer, attn in enumerate(attention):
        attn.set_processor(ReferenceWanSelfAttention(history, layer))
    sigmas = [float(s) for s in sigmas]
    latents = noise.clone()
    all_reads = []
    try:
        for block in range(total // frames_per_block):
            lo = block * frames_per_block
            first = block * n
            # The stock rotary tables over frames 0 .. block end; this block's rows.
            shape = (1, 1, lo + frames_per_block, height, width)
            cos, sin = model.rope(torch.empty(shape, device="meta"))
            history.rotary = (cos[:, -n:], sin[:, -n:])
            history.actions = None if actions is None else actions[block].expand(rows, -1, -1)
            positions = reads_of(geometry, first, n)
            past = [p for p in positions if p < first]
            assert positions[len(past) :] == list(range(first, first + n))
            history.read = torch.tensor(past, dtype=torch.int64)
            x = noise[:, :, lo : lo + frames_per_block]
            block_reads = []
            for step, sigma in enumerate([*sigmas, 0.0]):
                history.commit = step == len(sigmas)
                timestep = torch.full((rows,), 1000.0 * sigma, device=x.device)
                out = model(x.expand(rows, -1, -1, -1, -1), timestep, text, return_dict=False)[0]
                block_reads.append(ReferenceRead(block, step, history.commit, positions))
                if history.commit:
                    break
                flow = out[:1] if rows == 1 else out[1:] + guidance_scale * (out[:1] - out[1:])
                following = sigmas[step + 1] if step + 1 < len(sigmas) else 0.0
                x = x + (following - sigma) * flow
            latents[:, :, lo : lo + frames_per_block] = x
            all_reads.append(block_reads)
    finally:
        for attn, processor in zip(attention, stock, strict=True):
            attn.set_processor(processor)
    means = history.key_means if kv_dtype is not None and smooth_keys else None
    equalizers = history.equalizers if equalize else None
    return ReferenceRolloutResult(
        latents=latents, reads=all_reads, key_means=means, equalizers=equalizers
    )
