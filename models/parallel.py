"""Ulysses sequence parallel and CFG parallel for the paged Wan rollout, on ``torch.distributed``.

``world_size = cfg_degree * ulysses_degree`` ranks; rank ``r`` is CFG branch
``r // ulysses_degree`` and Ulysses rank ``r % ulysses_degree`` (``ParallelLayout``).

* **Ulysses** (``ulysses_degree = P``): the transformer blocks run on a sequence shard of the
  forward's tokens (split at ``blocks[0]``'s input and ``rope``'s output, gathered at
  ``proj_out``'s output, the split points of diffusers' ``WanTransformer3DModel._cp_plan``). In
  self-attention, q/k/v of the shard (every head) go through one ``all_to_all_single`` into
  every token of a head shard, the fused write+attend op runs on the rank's own
  ``PagedKVCache`` (built with ``heads / P`` KV heads, so its pools are ``1 / P`` of the
  single-process bytes), and one ``all_to_all_single`` brings the output back to the sequence
  shard with every head. Action tokens are replicated: each rank projects them and keeps its
  head shard, no communication.
* **CFG parallel** (``cfg_degree = 2``): each rank holds one branch (positive or negative text)
  in a one-branch cache and runs only that branch; one ``all_gather`` per denoising step
  combines the guided flow, identically on both ranks. The committing forward needs none.
* **Plans agree or fail loudly**: the paging plans are a pure function of the configuration and
  the call sequence, so every rank builds them itself. With ``check_plans`` (default) each
  forward all-gathers a 3-word digest of the plan (block table, lengths, slots, key gaps,
  staging, history) over all ranks, before any all-to-all; a mismatch raises
  ``PlanDivergenceError`` on every rank (they all see the same gathered digests).

diffusers' own context parallelism (``ContextParallelConfig(ulysses_degree=...)``) is not used:
its Ulysses all-to-all lives inside ``dispatch_attention_fn``'s dense attention backends, which
the paged processor never calls. The collectives are plain ``torch.distributed`` calls
(``models.distributed``), the same code path on gloo (CPU) and NCCL (one GPU per rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from paged_video.models.distributed import (
    ParallelGroups,
    ParallelLayout,
    PlanDivergenceError,
    check_plans_agree,
    heads_to_sequence,
    plan_digest,
    sequence_to_heads,
)
from paged_video.models.wan_paged import (
    CFG_BRANCHES,
    ForwardState,
    PagedWanAttnProcessor,
    PagedWanRollout,
    WanTransformer3DModel,
)
from paged_video.paging import PagingConfig
from paged_video.paging.forward import ForwardCall

__all__ = [
    "ParallelGroups",
    "ParallelLayout",
    "ParallelWanRollout",
    "PlanDivergenceError",
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
        self, state: ForwardState, layer: int, group: dist.ProcessGroup, degree: int, index: int
    ) -> None:
        super().__init__(state, layer)
        self.group = group
        self.degree = degree
        self.head_shard = index

    def attend(self, attn: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """The sequence shard's ``(rows, n / P, heads, head_dim)`` q/k/v in and out."""
        qkv = sequence_to_heads(torch.stack([query, key, value]), self.group, self.degree)
        out = super().attend(attn, *qkv.unbind(0))
        return heads_to_sequence(out, self.group, self.degree)


class ParallelWanRollout(PagedWanRollout):
    """``PagedWanRollout`` on one rank of a Ulysses x CFG layout.

    ``groups``: this rank's ``ParallelGroups``, or a ``ParallelLayout`` to build them from (every
    rank must then construct its rollout at the same point: ``new_group`` is collective).

    Every rank calls ``generate`` with the same arguments (both prompts included) and gets the
    same latents. ``config.chunk_size`` (tokens per frame) must be divisible by
    ``ulysses_degree``, the model's heads too; ``cfg_degree = 2`` needs ``guidance=True``.
    ``check_plans=False`` skips the per-forward plan digest (one small all-gather and a sync).
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
        if config.chunk_size % layout.ulysses_degree:
            raise ValueError(
                f"ulysses_degree ({layout.ulysses_degree}) must divide config.chunk_size "
                f"({config.chunk_size}, tokens per frame)"
            )
        if layout.cfg_degree == 2 and guidance is not True:
            raise ValueError("cfg_degree=2 needs guidance=True (one CFG branch per rank)")
        self.groups = groups
        self.check_plans = check_plans
        super().__init__(model, config, guidance=guidance, dtype=dtype)
        self._hooks = []
        if layout.ulysses_degree > 1:
            self._hooks = [
                model.rope.register_forward_hook(self._split_rotary),
                model.blocks[0].register_forward_pre_hook(self._split_sequence),
                model.proj_out.register_forward_hook(self._gather_sequence),
            ]

    def _local_branches(self) -> tuple[str, ...]:
        if self.groups.layout.cfg_degree == 2:
            return (CFG_BRANCHES[self.groups.cfg_index],)
        return super()._local_branches()

    def _local_heads(self, heads: int) -> int:
        return heads // self.groups.layout.ulysses_degree

    def _processor(self, layer: int) -> PagedWanAttnProcessor:
        groups = self.groups
        if groups.layout.ulysses_degree == 1:
            return super()._processor(layer)
        return UlyssesPagedWanAttnProcessor(
            self.state, layer, groups.ulysses, groups.layout.ulysses_degree, groups.ulysses_index
        )

    def _local_text(self, prompt_embeds: Tensor, negative_prompt_embeds: Tensor | None) -> Tensor:
        if self.groups.layout.cfg_degree == 2:
            return (prompt_embeds, negative_prompt_embeds)[self.groups.cfg_index]
        return super()._local_text(prompt_embeds, negative_prompt_embeds)

    def _guide(self, out: Tensor, guidance_scale: float) -> Tensor:
        """With CFG parallel: one all-gather of the two branches' outputs, then the same formula
        as the single-process rollout (so every rank computes the same flow)."""
        if self.groups.layout.cfg_degree == 1:
            return super()._guide(out, guidance_scale)
        branches = [torch.empty_like(out) for _ in range(2)]
        dist.all_gather(branches, out.contiguous(), group=self.groups.cfg)
        return super()._guide(torch.cat(branches), guidance_scale)

    def _before_model(self, call: ForwardCall, block: int, step: int) -> None:
        if self.check_plans:
            check_plans_agree(call, None, f"block {block}, forward {step}")

    def _split_rotary(self, module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
        """``rope``'s hook: this rank's shard of the rotary tables' tokens (after the rollout's
        own hook has put them at the block's absolute frames)."""
        index, degree = self.groups.ulysses_index, self.groups.layout.ulysses_degree
        return tuple(table.chunk(degree, dim=1)[index] for table in output)

    def _split_sequence(self, module: torch.nn.Module, args: tuple) -> tuple:
        """``blocks[0]``'s pre-hook: keep this rank's shard of the tokens."""
        hidden_states, *rest = args
        shards = hidden_states.chunk(self.groups.layout.ulysses_degree, dim=1)
        return (shards[self.groups.ulysses_index].contiguous(), *rest)

    def _gather_sequence(self, module: torch.nn.Module, args: tuple, output: Tensor) -> Tensor:
        """``proj_out``'s hook: every rank gets every token's output back, in rank order."""
        shards = [torch.empty_like(output) for _ in range(self.groups.layout.ulysses_degree)]
        dist.all_gather(shards, output.contiguous(), group=self.groups.ulysses)
        return torch.cat(shards, dim=1)

    def close(self) -> None:
        """Remove the sequence split/gather hooks and put the stock processors back."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        super().close()
