"""Ulysses, sequence-sharded window and CFG parallel for the paged Wan rollout.

``world_size = cfg_degree * kv_shard_degree * ulysses_degree`` ranks; rank
``r = (c * kv_shard_degree + s) * ulysses_degree + u`` is CFG branch ``c``, window shard ``s``
and Ulysses rank ``u`` (``ParallelLayout``). The forward's tokens are split over the
``kv_shard_degree * ulysses_degree`` ranks of a branch (token shard ``s * ulysses_degree + u``)
at ``blocks[0]``'s input and ``rope``'s output and gathered at ``proj_out``'s output, the split
points of diffusers' ``WanTransformer3DModel._cp_plan``; everything but self-attention runs on
the rank's token shard.

* **Ulysses** (``ulysses_degree = P``): q/k/v of the token shard (every head) go through one
  ``all_to_all_single`` into every token of the window shard's slice for ``heads / P`` heads;
  the cache holds ``heads / P`` KV heads (``1 / P`` of the bytes), and one ``all_to_all_single``
  brings the output back. Action tokens are replicated: each rank projects them and keeps its
  head shard, no communication.
* **Sequence-sharded window** (``kv_shard_degree = N``): each rank's ``ShardedKVCache`` stores
  ``1 / N`` of the window's blocks (``paging.shard``: round-robin by block of the
  single-process layout; every rank keeps the single-process bookkeeping). Per layer: one
  ``all_gather`` of the slice's q/k/v brings every token of the forward to every window shard;
  each writes the K/V of its own blocks and attends every query over its own keys, returning
  the partial output with its log-sum-exp; one ``all_to_all_single`` sends each slice's partial
  states to the rank that owns the slice, which merges the ``N`` partials exactly
  (``merge_stacked_attention_states``). The window never moves: the traffic is the chunk's, and
  the same whatever the window's length.
* **CFG parallel** (``cfg_degree = 2``): each rank holds one branch (positive or negative text)
  in a one-branch cache and runs only that branch; one ``all_gather`` per denoising step
  combines the guided flow, identically on every rank. The committing forward needs none. Over
  quantized pools a layer's first forward also all-gathers its K/V in the CFG group, so both
  ranks freeze the K mean and factors one process chooses from both branches.
* **Ranks agree or fail together** (``models.fail_fast``): ``generate`` first all-gathers a
  digest per argument (layout, configuration, model config, dtype, blocks, forwards per block,
  frames per block, sigmas, guidance scale, the noise's, prompts' and actions' shapes and
  bytes) and raises ``PlanDivergenceError`` on every rank naming what differs; with
  ``check_plans`` (default) each forward all-gathers a 3-word digest of its plan (block table,
  lengths, slots, key gaps, staging, history); the rollout ends by agreeing on its blocks,
  forwards and latents. A rank that raises posts its error on the rendezvous store and every
  other rank raises ``RankFailedError`` with it within a fraction of a second; a rank killed or
  stopped is noticed by its closed connections or its missing heartbeats. Every collective of
  the rollout is waited for that way.

diffusers' own context parallelism (``ContextParallelConfig(ulysses_degree=...)``) is not used:
its Ulysses all-to-all lives inside ``dispatch_attention_fn``'s dense attention backends, which
the paged processor never calls. The collectives are plain ``torch.distributed`` calls
(``models.distributed``), the same code path on gloo (CPU) and NCCL (one GPU per rank).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceOf

import torch
import torch.distributed as dist
from torch import Tensor

from paged_video.kernels.fused import write_attend
from paged_video.kernels.merge_states import merge_stacked_attention_states
from paged_video.kernels.write_slots import choose_unset
from paged_video.models.distributed import (
    ParallelGroups,
    ParallelLayout,
    PlanDivergenceError,
    all_gather,
    check_plans_agree,
    check_values_agree,
    exchange_partials,
    gather_chunk,
    heads_to_sequence,
    pack_states,
    plan_digest,
    sequence_to_heads,
    unpack_states,
)
from paged_video.models.fail_fast import FailFast, RankFailedError
from paged_video.models.wan_paged import (
    CFG_BRANCHES,
    ForwardState,
    PagedWanAttnProcessor,
    PagedWanRollout,
    RolloutResult,
    WanTransformer3DModel,
)
from paged_video.paging import PagedKVCache, PagingConfig
from paged_video.paging.forward import ForwardCall
from paged_video.paging.shard import ShardedForwardCall, ShardedKVCache

__all__ = [
    "FailFast",
    "ParallelGroups",
    "ParallelLayout",
    "ParallelWanRollout",
    "PlanDivergenceError",
    "RankFailedError",
    "ShardedPagedWanAttnProcessor",
    "UlyssesPagedWanAttnProcessor",
    "check_plans_agree",
    "plan_digest",
]


class UlyssesPagedWanAttnProcessor(PagedWanAttnProcessor):
    """``PagedWanAttnProcessor`` on a sequence shard, over this rank's head shard of the cache.

    ``hidden_states`` and the rotary tables are the rank's ``n / P`` tokens (every head); the
    projection step is the single-process one. The attention step is wrapped in two
    all-to-alls: every token of the rank's head shard in, the sequence shard of every head out.
    """

    def __init__(
        self,
        state: ForwardState,
        layer: int,
        group: dist.ProcessGroup,
        degree: int,
        index: int,
        guard: FailFast | None = None,
    ) -> None:
        super().__init__(state, layer)
        self.group = group
        self.degree = degree
        self.head_shard = index
        self.guard = guard

    def attend(self, attn: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """The sequence shard's ``(rows, n / P, heads, head_dim)`` q/k/v in and out."""
        qkv = torch.stack([query, key, value])
        qkv = sequence_to_heads(qkv, self.group, self.degree, self.guard)
        out = super().attend(attn, *qkv.unbind(0))
        return heads_to_sequence(out, self.group, self.degree, self.guard)


class ShardedPagedWanAttnProcessor(PagedWanAttnProcessor):
    """Self-attention on one rank of a (Ulysses x) sequence-sharded window.

    ``query``/``key``/``value`` are the rank's token shard, every head. Ulysses (degree > 1)
    turns them into the window shard's token slice for the rank's heads; the window shards
    gather every slice, attend over their own keys (``ShardedForwardCall`` gives the fused op
    this rank's blocks and slots), exchange the partial states and merge the slice's.
    """

    def __init__(self, state: ForwardState, layer: int, groups: ParallelGroups) -> None:
        super().__init__(state, layer)
        self.groups = groups
        self.head_shard = groups.ulysses_index

    def attend(self, attn: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        groups, layout = self.groups, self.groups.layout
        guard, ulysses = groups.guard, layout.ulysses_degree
        qkv = torch.stack([query, key, value])
        if ulysses > 1:
            qkv = sequence_to_heads(qkv, groups.ulysses, ulysses, guard)
        qkv = gather_chunk(qkv, groups.kv_shard, guard)
        # The base class packs the rows and calls ``launch``: partial states, every token.
        states = super().attend(attn, *qkv.unbind(0))
        parts = exchange_partials(states, groups.kv_shard, layout.kv_shard_degree, guard)
        outs, lses = unpack_states(parts.flatten(1, 2), query.shape[-1])
        out, _ = merge_stacked_attention_states(outs, lses)
        out = out.unflatten(0, parts.shape[1:3])
        if ulysses > 1:
            out = heads_to_sequence(out, groups.ulysses, ulysses, guard)
        return out

    def launch(
        self,
        call: ForwardCall,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        action_key: Tensor,
        action_value: Tensor,
    ) -> Tensor:
        """Write this rank's blocks' K/V and attend over its keys: the packed partial states
        (``pack_states``) of every query (``ShardedForwardCall``'s inputs ask for the LSE)."""
        if self.state.choose is not None:
            self.state.choose(call, self.layer, key, value)
        inputs = self.state.layer_inputs._replace(layer=self.layer_index)
        out, lse = write_attend(
            query, key, value, action_key, action_value, call.cache.pool_tensors, inputs
        )
        return pack_states(out, lse)


def _safely(compute: Callable[[], object]) -> object:
    """``compute()``, or the repr of its error: digests of arguments not yet validated."""
    try:
        return compute()
    except Exception as error:
        return f"{type(error).__name__}: {error}"


class ParallelWanRollout(PagedWanRollout):
    """``PagedWanRollout`` on one rank of a Ulysses x sequence-sharded window x CFG layout.

    ``groups``: this rank's ``ParallelGroups``, or a ``ParallelLayout`` to build them from (every
    rank must then construct its rollout at the same point: ``new_group`` is collective).

    Every rank calls ``generate`` with the same arguments (both prompts included) and gets the
    same latents. ``config.chunk_size`` (tokens per frame) must be divisible by
    ``ulysses_degree * kv_shard_degree``, the model's heads by ``ulysses_degree``;
    ``cfg_degree = 2`` needs ``guidance=True``. ``check_plans=False`` skips the per-forward plan
    digest (one small all-gather and a host sync per forward); the agreement on the arguments
    and on the end, and the failure flag, stay.
    Futures are not forked here yet (``generate`` with several rows of noise refuses): the CFG
    all-gather would have to interleave the futures' branches, and the cache holds one session.
    """

    _forks = False

    def __init__(
        self,
        model: WanTransformer3DModel,
        config: PagingConfig,
        groups: ParallelGroups | ParallelLayout,
        *,
        guidance: bool = True,
        dtype: torch.dtype | None = None,
        check_plans: bool = True,
    ) -> None:
        if isinstance(groups, ParallelLayout):
            groups = ParallelGroups(groups)
        if not isinstance(groups, ParallelGroups):
            raise TypeError(
                f"groups must be ParallelGroups or a ParallelLayout, got {type(groups).__name__}"
            )
        if not isinstance(check_plans, bool):
            raise TypeError(f"check_plans must be a bool, got {type(check_plans).__name__}")
        if not isinstance(model, WanTransformer3DModel):
            raise TypeError(f"model must be a WanTransformer3DModel, got {type(model).__name__}")
        if not isinstance(config, PagingConfig):
            raise TypeError(f"config must be a PagingConfig, got {type(config).__name__}")
        layout = groups.layout
        heads = model.config.num_attention_heads
        if heads % layout.ulysses_degree:
            raise ValueError(
                f"ulysses_degree ({layout.ulysses_degree}) must divide the model's heads ({heads})"
            )
        if config.chunk_size % layout.sequence_degree:
            raise ValueError(
                f"ulysses_degree * kv_shard_degree ({layout.sequence_degree}) must divide "
                f"config.chunk_size ({config.chunk_size}, tokens per frame)"
            )
        if layout.cfg_degree == 2 and guidance is not True:
            raise ValueError("cfg_degree=2 needs guidance=True (one CFG branch per rank)")
        self.groups = groups
        self.check_plans = check_plans
        self._forwards = 0
        super().__init__(model, config, guidance=guidance, dtype=dtype)
        if layout.cfg_degree == 2:
            self.state.choose = self._choose_across_branches
        self._hooks = []
        if layout.sequence_degree > 1:
            self._hooks = [
                model.rope.register_forward_hook(self._split_rotary),
                model.blocks[0].register_forward_pre_hook(self._split_sequence),
                model.proj_out.register_forward_hook(self._gather_sequence),
            ]

    @property
    def guard(self) -> FailFast:
        return self.groups.guard

    def _local_branches(self) -> tuple[str, ...]:
        if self.groups.layout.cfg_degree == 2:
            return (CFG_BRANCHES[self.groups.cfg_index],)
        return super()._local_branches()

    def _local_heads(self, heads: int) -> int:
        return heads // self.groups.layout.ulysses_degree

    def _make_cache(self, config: PagingConfig, **geometry: object) -> PagedKVCache:
        degree = self.groups.layout.kv_shard_degree
        if degree == 1:
            return super()._make_cache(config, **geometry)
        index = self.groups.kv_shard_index
        return ShardedKVCache(config, shard_degree=degree, shard_index=index, **geometry)

    def _forward_call(self, plans: list) -> ForwardCall:
        if self.groups.layout.kv_shard_degree == 1:
            return super()._forward_call(plans)
        return ShardedForwardCall(self.cache, plans, softmax_scale=self.softmax_scale)

    def _processor(self, layer: int) -> PagedWanAttnProcessor:
        groups, layout = self.groups, self.groups.layout
        if layout.kv_shard_degree > 1:
            return ShardedPagedWanAttnProcessor(self.state, layer, groups)
        if layout.ulysses_degree > 1:
            return UlyssesPagedWanAttnProcessor(
                self.state,
                layer,
                groups.ulysses,
                layout.ulysses_degree,
                groups.ulysses_index,
                groups.guard,
            )
        return super()._processor(layer)

    def _choose_across_branches(
        self, call: ForwardCall, layer: int, key: Tensor, value: Tensor
    ) -> None:
        """CFG parallel: a layer's first write freezes what it chooses (over quantized pools:
        the K mean, the equalization factors, k8v8's V channel scales) from both branches'
        rows, as one process's batched forward does: one all-gather of this forward's K/V in
        the CFG group (positive rows first, one process's order), then the rule
        ``write_slots`` follows. A layer whose flags are set (every later forward; float pools
        have none) gathers nothing."""
        written = call.cache.layer(layer).write_kwargs()
        # Only what a first write chooses, with its flags (not the scales, not k8v8's count).
        state = {
            name: t
            for name, t in written.items()
            if name not in ("k_scale", "v_scale", "v_saturated")
        }
        if all(bool(flag) for name, flag in state.items() if name.endswith("_chosen")):
            return
        kv = all_gather(torch.stack([key, value]), self.groups.cfg, self.guard, "CFG choice")
        keys, values = (torch.cat(kv[:, i].unbind(0)) for i in range(2))
        every_row = torch.zeros(keys.shape[0], dtype=torch.int64, device=keys.device)
        choose_unset(keys, values, every_row, **state)

    def _local_text(self, prompt_embeds: Tensor, negative_prompt_embeds: Tensor | None) -> Tensor:
        if self.groups.layout.cfg_degree == 2:
            return (prompt_embeds, negative_prompt_embeds)[self.groups.cfg_index]
        return super()._local_text(prompt_embeds, negative_prompt_embeds)

    def _guide(self, out: Tensor, guidance_scale: float) -> Tensor:
        """With CFG parallel: one all-gather of the two branches' outputs, then the same formula
        as the single-process rollout (so every rank computes the same flow)."""
        if self.groups.layout.cfg_degree == 1:
            return super()._guide(out, guidance_scale)
        branches = all_gather(out, self.groups.cfg, self.guard, "CFG all-gather")
        return super()._guide(torch.cat(branches.unbind(0)), guidance_scale)

    def _before_model(self, call: ForwardCall, block: int, step: int) -> None:
        self.guard.where = f"block {block}, forward {step}"
        self._forwards += 1
        if self.check_plans:
            check_plans_agree(call, None, self.guard.where, self.guard)

    def _split_rotary(self, module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
        """``rope``'s hook: this rank's shard of the rotary tables' tokens (after the rollout's
        own hook has put them at the block's absolute frames)."""
        index, degree = self.groups.sequence_index, self.groups.layout.sequence_degree
        return tuple(table.chunk(degree, dim=1)[index] for table in output)

    def _split_sequence(self, module: torch.nn.Module, args: tuple) -> tuple:
        """``blocks[0]``'s pre-hook: keep this rank's shard of the tokens."""
        hidden_states, *rest = args
        shards = hidden_states.chunk(self.groups.layout.sequence_degree, dim=1)
        return (shards[self.groups.sequence_index].contiguous(), *rest)

    def _gather_sequence(self, module: torch.nn.Module, args: tuple, output: Tensor) -> Tensor:
        """``proj_out``'s hook: every rank gets every token's output back, in rank order."""
        shards = all_gather(output, self.groups.sequence, self.guard, "sequence all-gather")
        return torch.cat(shards.unbind(0), dim=1)

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
    ) -> RolloutResult:
        """``PagedWanRollout.generate`` on every rank at once (same arguments everywhere).

        Before anything runs, the ranks agree on the arguments (``PlanDivergenceError`` naming
        the ones that differ, on every rank); a rank that raises later posts its error, and
        the others raise ``RankFailedError`` with it; at the end the ranks agree on the blocks
        and forwards they ran and on the latents.
        """
        guard = self.guard
        guard.where = "the start of the rollout"
        self._forwards = 0
        check_values_agree(
            self._arguments(
                noise,
                prompt_embeds,
                negative_prompt_embeds,
                frames_per_block,
                sigmas,
                guidance_scale,
                actions,
            ),
            None,
            guard.where,
            guard,
        )
        # The same arguments everywhere: a refusal here happens on every rank alike.
        self._check(
            noise,
            prompt_embeds,
            negative_prompt_embeds,
            frames_per_block,
            sigmas,
            guidance_scale,
            actions,
            None,  # fork_after: the parallel rollouts fork no futures
        )
        try:
            result = super().generate(
                noise,
                prompt_embeds,
                negative_prompt_embeds,
                frames_per_block=frames_per_block,
                sigmas=sigmas,
                guidance_scale=guidance_scale,
                actions=actions,
                record_reads=record_reads,
                on_block=on_block,
            )
        except (PlanDivergenceError, RankFailedError):
            raise  # every rank raises these together, or one posted already
        except BaseException as error:
            guard.post(f"raised at {guard.where}: {type(error).__name__}: {error}")
            raise
        guard.where = "the end of the rollout"
        ended = {
            "blocks": len(result.reads),
            "forwards": self._forwards,
            "latents": result.latents,
        }
        check_values_agree(ended, None, guard.where, guard)
        return result

    def _arguments(
        self,
        noise,
        prompt_embeds,
        negative_prompt_embeds,
        frames_per_block,
        sigmas,
        guidance_scale,
        actions,
    ) -> dict[str, object]:
        """What every rank must agree on before a rollout (values, or digests of tensors)."""
        frames = _safely(lambda: noise.shape[2])
        return {
            "layout": self.groups.layout,
            "config": self.config,
            # Sorted, private keys out (diffusers lists its defaults in set order).
            "model": sorted((k, v) for k, v in self.model.config.items() if k[0] != "_"),
            "dtype": self.cache.k_pools.dtype,
            "check_plans": self.check_plans,
            "blocks": _safely(lambda: frames // frames_per_block),
            "forwards per block": _safely(lambda: len(sigmas) + 1),
            "frames_per_block": frames_per_block,
            "sigmas": _safely(lambda: tuple(float(s) for s in sigmas)),
            "guidance_scale": guidance_scale,
            "noise": noise,
            "prompt_embeds": prompt_embeds,
            "negative_prompt_embeds": negative_prompt_embeds,
            "actions": actions,
        }

    def close(self) -> None:
        """Remove the sequence split/gather hooks and put the stock processors back."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        super().close()
