"""Autoregressive rollout of a diffusers Wan transformer on the paged KV cache.

``PagedWanRollout`` replaces the self-attention processor of every block of a
``diffusers.WanTransformer3DModel`` with ``PagedWanAttnProcessor`` and generates a video block
by block, as the autoregressive Wan models (CausVid, Self-Forcing) do: per block a few denoising
forwards that only read the history (scratch plans), then one forward on the clean block that
commits its K/V. Both CFG branches (positive / negative text) run as one batch of the model and
one attention launch. The model's own ``forward`` runs unchanged; only two things differ from
the stock model:

* self-attention writes this block's K/V into the paged pools and attends over the window the
  cache keeps (``paging.forward.ForwardCall``, the fused write+attend op);
* the rotary embedding is taken at each token's *absolute* frame: the block's frames come after
  the history (a forward hook on ``model.rope`` for the duration of the forward).

Cross-attention keeps the stock processor. ``reference/wan_rollout.py`` is the dense oracle.

Several futures of one past: ``generate(noise, ..., fork_after=b)`` with ``K`` rows of noise
generates the first ``b`` blocks once, forks the session ``K - 1`` times (the forks share the
history's blocks, ``PagedKVCache.fork``) and continues the ``K`` futures with their own noise and
actions, all of them one batch of the model and one attention launch per step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch
from torch import Tensor

# kernels (also imported by paging.forward), without a GPU, switches Triton's interpreter on; that
# must happen before triton is imported, and importing diffusers imports triton.
from paged_video.kernels.fused import LayerInputs, write_attend
from paged_video.paging import PagedKVCache, PagingConfig
from paged_video.paging.forward import ForwardCall

try:
    from diffusers import WanTransformer3DModel
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("models.wan_paged needs diffusers: pip install -e '.[diffusers]'") from error

CFG_BRANCHES = ("positive", "negative")


def apply_rotary(hidden_states: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> Tensor:
    """The stock ``WanAttnProcessor`` rotary embedding (interleaved pairs), unchanged."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


def absolute_rotary(
    rope: torch.nn.Module, first_frame: int, frames: int, height: int, width: int
) -> tuple[Tensor, Tensor]:
    """``WanRotaryPosEmbed.forward`` with the temporal positions ``first_frame .. + frames - 1``.

    ``frames``, ``height`` and ``width`` are in patches. Returns ``(cos, sin)``, each
    ``(1, frames * height * width, 1, head_dim)``, as the stock module does for frame 0 on.
    """
    if first_frame + frames > rope.max_seq_len:
        raise ValueError(
            f"first_frame + frames must be <= rope_max_seq_len ({rope.max_seq_len}), "
            f"got {first_frame} + {frames}"
        )
    split = [rope.t_dim, rope.h_dim, rope.w_dim]
    grids = []
    for table in (rope.freqs_cos, rope.freqs_sin):
        t, h, w = table.split(split, dim=1)
        shape = (frames, height, width, -1)
        grid = torch.cat(
            [
                t[first_frame : first_frame + frames].view(frames, 1, 1, -1).expand(shape),
                h[:height].view(1, height, 1, -1).expand(shape),
                w[:width].view(1, 1, width, -1).expand(shape),
            ],
            dim=-1,
        )
        grids.append(grid.reshape(1, frames * height * width, 1, -1))
    return grids[0], grids[1]


def wan_qkv(attn: torch.nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v as the stock processor makes them: projections, RMS norm, heads split."""
    if getattr(attn, "fused_projections", False):
        query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
    else:
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)
    query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
    key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
    return query, key, value.unflatten(2, (attn.heads, -1))


class ForwardState:
    """What the processors of one model share during a forward: the call, its fused-op inputs
    and the actions."""

    def __init__(self) -> None:
        self.call: ForwardCall | None = None
        # call.layer(0), taken once per forward outside any compiled region: ForwardCall.layer
        # checks the plans' Python state, which torch.compile would turn into guards that
        # change every forward (a recompile per forward).
        self.layer_inputs: LayerInputs | None = None
        self.action_states: Tensor | None = None
        # Called with (call, layer, key, value) before each layer's write when this process
        # holds only some rows of the one-process forward (CFG parallel: one branch), to choose
        # a layer's first-write state from all of them (``models.parallel``); None: from its own.
        self.choose: Callable[[ForwardCall, int, Tensor, Tensor], None] | None = None


class PagedWanAttnProcessor:
    """Wan self-attention over the paged cache: stock q/k/v, then the fused write+attend op.

    Two steps, so that a parallel processor replaces only the second: ``project`` (the stock
    projections, RMS norm and rotary embedding) and ``attend`` (write K/V, attend over the
    window). The batch rows of the hidden states are the rows of ``state.call`` (one per plan,
    e.g. the positive and negative CFG branches), packed in plan order into one attention
    launch. ``state.action_states`` (``(rows, actions, dim)`` or None) are projected by this
    layer's K/V projections into action keys that every query reads and nothing commits.
    """

    # Which shard of the model's heads the cache holds (heads ``shard * h .. (shard + 1) * h``
    # for ``h`` heads per attend); 0 with every head. Ulysses ranks hold their own shard.
    head_shard = 0

    def __init__(self, state: ForwardState, layer: int) -> None:
        self.state = state
        self.layer = layer
        # A 0-dim tensor, not an int: compiled blocks of every layer then share one graph
        # (torch.compile specialises on int attributes).
        self.layer_index = torch.tensor(layer)

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        rotary_emb: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        name = type(self).__name__
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError(f"{name} is for self-attention without a mask")
        if self.state.call is None:
            raise RuntimeError(f"{name}: no forward in progress (use the rollout)")
        query, key, value = self.project(attn, hidden_states, rotary_emb)
        out = self.attend(attn, query, key, value)
        out = attn.to_out[0](out.flatten(2, 3).type_as(hidden_states))
        return attn.to_out[1](out)

    def project(
        self,
        attn: torch.nn.Module,
        hidden_states: Tensor,
        rotary_emb: tuple[Tensor, Tensor] | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v ``(rows, tokens, heads, head_dim)`` as the stock processor makes them, q and
        k rotated by ``rotary_emb`` (one row per token of ``hidden_states``)."""
        query, key, value = wan_qkv(attn, hidden_states)
        if rotary_emb is not None:
            if rotary_emb[0].shape[1] != query.shape[1]:
                raise ValueError(
                    f"rotary_emb must have one row per token ({query.shape[1]}), "
                    f"got {rotary_emb[0].shape[1]}"
                )
            query = apply_rotary(query, *rotary_emb)
            key = apply_rotary(key, *rotary_emb)
        return query, key, value

    def attend(self, attn: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Write the K/V and attend over the window and the action keys: ``(rows, tokens,
        heads, head_dim)`` in and out, ``heads`` the cache's (shard ``head_shard`` of the
        model's)."""
        rows, tokens, heads = query.shape[:3]
        key, value = key.flatten(0, 1), value.flatten(0, 1)
        action_key, action_value = key[:0], value[:0]
        actions = self.state.action_states
        if actions is not None:
            _, action_key, action_value = wan_qkv(attn, actions.to(query.dtype))
            own = slice(self.head_shard * heads, (self.head_shard + 1) * heads)
            action_key = action_key[:, :, own].flatten(0, 1)
            action_value = action_value[:, :, own].flatten(0, 1)
        call = self.state.call
        out = self.launch(call, query.flatten(0, 1), key, value, action_key, action_value)
        return out.unflatten(0, (rows, tokens))

    def launch(
        self,
        call: ForwardCall,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        action_key: Tensor,
        action_value: Tensor,
    ) -> Tensor:
        """The fused op for this layer (``ForwardCall.attend(layer, ...)`` with the layer index
        as a tensor): packed ``(tokens, heads, head_dim)`` q/k/v in, the same shape out."""
        if self.state.choose is not None:
            self.state.choose(call, self.layer, key, value)
        return write_attend(
            query,
            key,
            value,
            action_key,
            action_value,
            call.cache.pool_tensors,
            self.state.layer_inputs._replace(layer=self.layer_index),
        )


@dataclass(frozen=True)
class ForwardRead:
    """What one forward of the rollout read.

    ``positions[branch]``: model positions (token index in the video, ascending) of the video
    keys attention read, boundary tokens included unless the window is exact;
    ``blocks[branch]``: the block ids of the row's block table that were read, in key order
    (pool blocks, then scratch blocks). A forward of forked futures (after ``fork_after``) keys
    both by ``(future, branch)`` instead; ``stage_from``: the first block restaged into the
    history staging buffers (-1: attended over the paged pools); ``free_blocks``: free pool
    blocks after the forward.
    """

    block: int
    step: int
    commit: bool
    timestep: float
    first_frame: int
    positions: dict[str | tuple[int, str], list[int]]
    blocks: dict[str | tuple[int, str], list[int]]
    action_tokens: int
    stage_from: int
    free_blocks: int


@dataclass(frozen=True)
class RolloutResult:
    """The generated latents ``(futures, channels, frames, height, width)`` (one future unless
    forked) and, per generated block, one ``ForwardRead`` per forward (the denoising forwards,
    then the committing one)."""

    latents: Tensor
    reads: list[list[ForwardRead]]


def _require_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class PagedWanRollout:
    """A Wan model generating video block by block over a ``PagedKVCache``.

    Installs ``PagedWanAttnProcessor`` on every block's self-attention (``close`` puts the stock
    processors back; also a context manager). ``config.chunk_size`` must be the tokens of one
    latent frame after patching (``(height / 2) * (width / 2)`` for Wan's patch), and
    ``config.max_forward_chunks`` at least the frames per block. ``guidance=True`` keeps two
    KV branches (positive and negative text), run as one batch; ``False`` one branch. A
    quantized ``config.kv_dtype`` (``int8``) or ``config.kv_format``
    (``"k8v8"``, ``"k8v16"``, history staging included) needs nothing more: the cache holds
    codes, scales and K means, and the fused op writes and attends over them.
    ``session_capacity`` is the most futures ``generate`` may fork (a fork is a session);
    ``pool_blocks`` sizes the pool by blocks instead of sessions (``PagedKVCache``).

    ``models.parallel.ParallelWanRollout`` overrides the ``_local_*``, ``_make_cache``,
    ``_forward_call``, ``_guide`` and ``_before_model`` hooks to shard the heads (Ulysses), the
    window (sequence-sharded) or the CFG branches over ranks.
    """

    def __init__(
        self,
        model: WanTransformer3DModel,
        config: PagingConfig,
        *,
        guidance: bool = True,
        dtype: torch.dtype | None = None,
        session_capacity: int = 1,
        pool_blocks: int | None = None,
    ) -> None:
        if not isinstance(model, WanTransformer3DModel):
            raise TypeError(f"model must be a WanTransformer3DModel, got {type(model).__name__}")
        if not isinstance(config, PagingConfig):
            raise TypeError(f"config must be a PagingConfig, got {type(config).__name__}")
        if not isinstance(guidance, bool):
            raise TypeError(f"guidance must be a bool, got {type(guidance).__name__}")
        _require_int("session_capacity", session_capacity, 1)
        parameter = model.blocks[0].attn1.to_k.weight
        heads = model.config.num_attention_heads
        head_dim = model.config.attention_head_dim
        self.model = model
        self.config = config
        self.guided = guidance
        self.branches = self._local_branches()
        self.cache = self._make_cache(
            config,
            num_layers=len(model.blocks),
            num_kv_heads=self._local_heads(heads),
            head_dim=head_dim,
            branches=self.branches,
            session_capacity=session_capacity,
            dtype=dtype or parameter.dtype,
            device=parameter.device,
            pool_blocks=pool_blocks,
        )
        self.softmax_scale = float(head_dim**-0.5)
        self.state = ForwardState()
        self._attention = [block.attn1 for block in model.blocks]
        self._stock = [attn.processor for attn in self._attention]
        for layer, attn in enumerate(self._attention):
            attn.set_processor(self._processor(layer))
        # Slot -> model position written there last (-1: never a video token); for the records.
        slots = self.cache.num_blocks * config.block_size
        self._ledger = torch.full((slots,), -1, dtype=torch.int64, device=parameter.device)
        # A block the cache copies (a fork's shared tail) takes its positions along.
        copy_contents = self.cache.pool.copy_contents

        def copy_with_positions(source: int, target: int) -> None:
            copy_contents(source, target)
            b = config.block_size
            self._ledger[target * b : (target + 1) * b] = self._ledger[
                source * b : (source + 1) * b
            ]

        self.cache.pool.copy_contents = copy_with_positions

    def _local_branches(self) -> tuple[str, ...]:
        """The KV branches this process holds (and the batch rows of each model forward)."""
        return CFG_BRANCHES if self.guided else ("main",)

    def _local_heads(self, heads: int) -> int:
        """The KV heads this process's pools hold."""
        return heads

    def _make_cache(self, config: PagingConfig, **geometry: object) -> PagedKVCache:
        """This process's cache (a parallel rollout may hold a share of the window)."""
        return PagedKVCache(config, **geometry)

    def _forward_call(self, plans: list) -> ForwardCall:
        """The attention side of one forward of ``plans`` on this process's cache."""
        return ForwardCall(self.cache, plans, softmax_scale=self.softmax_scale)

    # Whether ``generate`` may fork futures (batched rows of one model forward).
    _forks = True

    def _processor(self, layer: int) -> PagedWanAttnProcessor:
        return PagedWanAttnProcessor(self.state, layer)

    def _local_text(self, prompt_embeds: Tensor, negative_prompt_embeds: Tensor | None) -> Tensor:
        """The text embeddings of this process's branches, one batch row each."""
        if negative_prompt_embeds is None:
            return prompt_embeds
        return torch.cat([prompt_embeds, negative_prompt_embeds])

    def _guide(self, out: Tensor, guidance_scale: float) -> Tensor:
        """The flow of a denoising step from the model's output rows, one per future (the
        rows are the futures' positive and negative branches in turn)."""
        if not self.guided:
            return out
        branches = out.unflatten(0, (-1, 2))
        positive, negative = branches[:, 0], branches[:, 1]
        return negative + guidance_scale * (positive - negative)

    def _before_model(self, call: ForwardCall, block: int, step: int) -> None:
        """Called with each forward's prepared call, before the model runs (a failure cancels)."""

    def close(self) -> None:
        """Put the stock self-attention processors back."""
        for attn, processor in zip(self._attention, self._stock, strict=True):
            attn.set_processor(processor)

    def __enter__(self) -> PagedWanRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @torch.no_grad()
    def generate(
        self,
        noise: Tensor,
        prompt_embeds: Tensor,
        negative_prompt_embeds: Tensor | None = None,
        *,
        frames_per_block: int,
        sigmas: SequenceOf[float] = (1.0, 0.75, 0.5, 0.25),
        guidance_scale: float = 5.0,
        actions: Tensor | None = None,
        record_reads: bool = True,
        on_block: Callable[[int], None] | None = None,
        fork_after: int | None = None,
    ) -> RolloutResult:
        """Generate ``noise.shape[2] / frames_per_block`` blocks, one session of the cache.

        ``noise``: ``(1, channels, frames, height, width)``, one block's slice per block.
        ``prompt_embeds`` / ``negative_prompt_embeds``: ``(1, text_tokens, text_dim)`` (the
        negative one iff ``guidance``). Per block, for each ``sigma`` in ``sigmas`` (flow
        matching, decreasing in (0, 1]) a scratch forward at timestep ``1000 * sigma`` and an
        Euler step to the next sigma (the last to 0), then a committing forward at timestep 0
        on the clean block. With guidance the flow is ``neg + guidance_scale * (pos - neg)``.
        ``actions``: ``(blocks, action_tokens, inner_dim)`` hidden states, keys of every
        forward of their block, never committed. ``record_reads=False`` skips the per-forward
        records (a device sync each); ``on_block(block)`` is called after each block. A k8v8
        cache's V that its frozen channel scales could not hold raises ``ValueError`` at the end
        of its block (``PagedKVCache.check_v_saturation``).

        Futures: ``noise`` of ``K`` rows and ``fork_after=b`` generate the first ``b`` blocks
        once (the rows must agree on them), fork the session into ``K`` sessions sharing that
        history and generate each row's later blocks in it, the ``K`` futures batched in one
        model forward and one attention launch per step; ``actions`` may then be ``(K, blocks,
        action_tokens, inner_dim)``, each future's own (agreeing on the first ``b`` blocks).
        The latents are those of ``K`` separate rollouts of the rows; the cache needs
        ``session_capacity >= K``.
        """
        blocks, frames, futures = self._check(
            noise,
            prompt_embeds,
            negative_prompt_embeds,
            frames_per_block,
            sigmas,
            guidance_scale,
            actions,
            fork_after,
        )
        if actions is not None and actions.dim() == 3:
            actions = actions.unsqueeze(0).expand(futures, -1, -1, -1)
        text = self._local_text(prompt_embeds, negative_prompt_embeds)
        sigmas = [float(s) for s in sigmas]
        latents = noise.clone()
        reads: list[list[ForwardRead]] = []
        sessions = [self.cache.open_session()]
        try:
            for block in range(blocks):
                if block == fork_after:
                    sessions += [self.cache.fork(sessions[0]) for _ in range(futures - 1)]
                rows = len(sessions)
                lo = block * frames_per_block
                x = noise[:rows, :, lo : lo + frames_per_block]
                action = None if actions is None else actions[:rows, block]
                first_frame = block * frames
                block_reads = []
                for step, sigma in enumerate(sigmas):
                    out, read = self._forward(
                        sessions,
                        x,
                        1000.0 * sigma,
                        first_frame,
                        text,
                        action,
                        block=block,
                        step=step,
                        commit=False,
                        record=record_reads,
                    )
                    flow = self._guide(out, guidance_scale)
                    following = sigmas[step + 1] if step + 1 < len(sigmas) else 0.0
                    x = x + (following - sigma) * flow
                    block_reads.append(read)
                _, read = self._forward(
                    sessions,
                    x,
                    0.0,
                    first_frame,
                    text,
                    action,
                    block=block,
                    step=len(sigmas),
                    commit=True,
                    record=record_reads,
                )
                block_reads.append(read)
                # k8v8: a block whose V its frozen scales could not hold is an error, not a
                # latent (one sync a block).
                self.cache.check_v_saturation()
                latents[:, :, lo : lo + frames_per_block] = x
                reads.append(block_reads if record_reads else [])
                if on_block is not None:
                    on_block(block)
        finally:
            for session in sessions:
                self.cache.close_session(session)
        return RolloutResult(latents=latents, reads=reads)

    def _check(
        self,
        noise,
        prompt_embeds,
        negative_prompt_embeds,
        frames_per_block,
        sigmas,
        guidance_scale,
        actions,
        fork_after,
    ) -> tuple[int, int, int]:
        """Validate ``generate``'s arguments; returns (blocks, patched frames per block,
        futures)."""
        model_config = self.model.config
        p_t, p_h, p_w = model_config.patch_size
        if not isinstance(noise, Tensor) or noise.dim() != 5 or noise.shape[0] < 1:
            raise ValueError(
                "noise must be a (futures, channels, frames, height, width) tensor, got "
                f"{tuple(noise.shape) if isinstance(noise, Tensor) else type(noise).__name__}"
            )
        _require_int("frames_per_block", frames_per_block, 1)
        futures, channels, total, height, width = noise.shape
        if channels != model_config.in_channels:
            raise ValueError(f"noise must have {model_config.in_channels} channels, got {channels}")
        if frames_per_block % p_t or total % frames_per_block or total == 0:
            raise ValueError(
                f"noise frames ({total}) must be a non-zero multiple of frames_per_block "
                f"({frames_per_block}), itself a multiple of the temporal patch ({p_t})"
            )
        if height % p_h or width % p_w:
            raise ValueError(f"noise height and width must be multiples of the patch {p_h}x{p_w}")
        tokens = (height // p_h) * (width // p_w)
        frames = frames_per_block // p_t
        if tokens != self.config.chunk_size:
            raise ValueError(
                f"config.chunk_size must be the tokens per latent frame ({tokens}), "
                f"got {self.config.chunk_size}"
            )
        if frames > self.config.max_forward_chunks:
            raise ValueError(
                f"frames_per_block ({frames} patched frames) must be <= config.max_forward_chunks "
                f"({self.config.max_forward_chunks})"
            )
        guided = self.guided
        for name, embeds in (
            ("prompt_embeds", prompt_embeds),
            ("negative_prompt_embeds", negative_prompt_embeds),
        ):
            if embeds is None and name == "negative_prompt_embeds" and not guided:
                continue
            if not isinstance(embeds, Tensor) or embeds.dim() != 3 or embeds.shape[0] != 1:
                raise ValueError(
                    f"{name} must be a (1, text_tokens, text_dim) tensor"
                    + (" (the rollout was built with guidance=True)" if embeds is None else "")
                )
        if not guided and negative_prompt_embeds is not None:
            raise ValueError("negative_prompt_embeds needs a rollout built with guidance=True")
        if (
            not sigmas
            or any(not 0.0 < float(s) <= 1.0 for s in sigmas)
            or any(float(a) <= float(b) for a, b in itertools.pairwise(sigmas))
        ):
            raise ValueError(f"sigmas must be non-empty, decreasing, in (0, 1], got {sigmas!r}")
        if not isinstance(guidance_scale, int | float) or isinstance(guidance_scale, bool):
            raise TypeError(f"guidance_scale must be a float, got {type(guidance_scale).__name__}")
        blocks = total // frames_per_block
        inner = model_config.num_attention_heads * model_config.attention_head_dim
        per_future = actions is not None and isinstance(actions, Tensor) and actions.dim() == 4
        if actions is not None and (
            not isinstance(actions, Tensor)
            or actions.dim() not in (3, 4)
            or (per_future and actions.shape[0] != futures)
            or actions.shape[-3] != blocks
            or actions.shape[-1] != inner
            or not 1 <= actions.shape[-2] <= self.config.max_action_tokens
        ):
            raise ValueError(
                f"actions must be a ({blocks}, 1..{self.config.max_action_tokens}, {inner}) "
                "tensor (blocks, action tokens <= config.max_action_tokens, inner dim), or "
                f"({futures}, {blocks}, ...) with one row per future"
            )
        if blocks * frames > self.model.rope.max_seq_len:
            raise ValueError(
                f"the video has {blocks * frames} patched frames, more than the model's "
                f"rope_max_seq_len ({self.model.rope.max_seq_len})"
            )
        self._check_futures(noise, actions if per_future else None, fork_after, blocks)
        return blocks, frames, futures

    def _check_futures(
        self, noise: Tensor, actions: Tensor | None, fork_after: object, blocks: int
    ) -> None:
        """``fork_after`` fits the rows of ``noise`` (and per-future ``actions``)."""
        futures = noise.shape[0]
        if fork_after is None:
            if futures != 1 or actions is not None:
                raise ValueError(
                    f"noise has {futures} rows (futures) or actions one per future: give "
                    "fork_after, the blocks they share"
                )
            return
        _require_int("fork_after", fork_after, 0)
        if fork_after > blocks:
            raise ValueError(f"fork_after must be in 0..{blocks} (the blocks), got {fork_after}")
        if futures > 1 and not self._forks:
            raise ValueError(
                f"{type(self).__name__} does not fork futures; generate them one by one"
            )
        if futures > self.cache.session_capacity:
            raise ValueError(
                f"noise has {futures} rows (futures), more than the rollout's session_capacity "
                f"({self.cache.session_capacity}); build it with session_capacity >= {futures}"
            )
        shared = fork_after * noise.shape[2] // blocks
        for name, tensor, frames in (("noise", noise, shared), ("actions", actions, fork_after)):
            if tensor is None:
                continue
            history = tensor[:, :, :frames] if name == "noise" else tensor[:, :frames]
            if not torch.equal(history, history[:1].expand_as(history)):
                raise ValueError(
                    f"{name} rows (futures) must agree on the first fork_after={fork_after} "
                    "blocks: the history they share"
                )

    def _forward(
        self,
        sessions: list,
        x: Tensor,
        timestep: float,
        first_frame: int,
        text: Tensor,
        action: Tensor | None,
        *,
        block: int,
        step: int,
        commit: bool,
        record: bool,
    ) -> tuple[Tensor, ForwardRead | None]:
        """One model forward of every branch of every session (one batch, one attention
        launch per layer): ``x`` and ``action`` have a row per session."""
        futures, branches = len(sessions), len(self.branches)
        tokens = self.config.chunk_size * (x.shape[2] // self.model.config.patch_size[0])
        action_tokens = 0 if action is None else action.shape[1]
        plans = [
            self.cache.plan(session, branch, tokens, commit=commit, action_tokens=action_tokens)
            for session in sessions
            for branch in self.branches
        ]

        def per_row(tensor: Tensor) -> Tensor:
            """A row per plan: each session's row for each of its branches (a view for one)."""
            return tensor.unsqueeze(1).expand(futures, branches, *tensor.shape[1:]).flatten(0, 1)

        try:
            call = self._forward_call(plans)
            self._before_model(call, block, step)
            self.state.call = call
            self.state.layer_inputs = call.layer(0)
            if action is not None:
                self.state.action_states = per_row(action)
            # Prepended: the sequence split of a Ulysses rollout (a permanent hook on the rope)
            # must shard these tables, not the stock ones.
            hook = self.model.rope.register_forward_hook(rope_at_frame(first_frame), prepend=True)
            try:
                out = self.model(
                    per_row(x),
                    torch.full((futures * branches,), timestep, device=x.device),
                    text.unsqueeze(0).expand(futures, *text.shape).flatten(0, 1),
                    return_dict=False,
                )[0]
            finally:
                hook.remove()
                self.state.call = None
                self.state.layer_inputs = None
                self.state.action_states = None
        except BaseException:
            for plan in plans:
                plan.cancel()
            raise
        call.commit()
        read = self._read(call, block, step, commit, timestep, first_frame) if record else None
        return out, read

    def _read(
        self,
        call: ForwardCall,
        block: int,
        step: int,
        commit: bool,
        timestep: float,
        first_frame: int,
    ) -> ForwardRead:
        """The model positions and blocks each row's attention read (after its writes)."""
        b = self.config.block_size
        for plan in call.plans:
            positions = torch.arange(plan.history, plan.history + plan.num_tokens)
            self._ledger[plan.inputs.video_slots] = positions.to(self._ledger.device)
        inputs = call.inputs
        table, lengths = inputs.block_table.cpu(), inputs.seq_lens_k.cpu()
        gaps = inputs.key_gap.cpu().view(len(call.plans), -1, 2)
        ledger = self._ledger.cpu()
        positions, blocks = {}, {}
        forked = len(call.plans) > len(self.branches)
        for row, plan in enumerate(call.plans):
            keys = torch.arange(int(lengths[row]) - plan.action_tokens)
            if inputs.exact_window:
                for lo, hi in gaps[row].tolist():
                    keys = keys[(keys < lo) | (keys >= hi)]
            slots = table[row].to(torch.int64)[keys // b] * b + keys % b
            key = (row // len(self.branches), plan.branch) if forked else plan.branch
            positions[key] = ledger[slots].tolist()
            blocks[key] = table[row, : math.ceil(int(lengths[row]) / b)].tolist()
        return ForwardRead(
            block=block,
            step=step,
            commit=commit,
            timestep=timestep,
            first_frame=first_frame,
            positions=positions,
            blocks=blocks,
            action_tokens=call.plans[0].action_tokens,
            stage_from=call.stage_from,
            free_blocks=self.cache.pool.num_free,
        )


def rope_at_frame(first_frame: int):
    """A forward hook for ``model.rope``: the rotary tables from frame ``first_frame`` on."""

    def hook(rope: torch.nn.Module, args: tuple, output: object) -> tuple[Tensor, Tensor]:
        _, _, frames, height, width = args[0].shape
        p_t, p_h, p_w = rope.patch_size
        return absolute_rotary(rope, first_frame, frames // p_t, height // p_h, width // p_w)

    return hook
