"""One forward through the fused write+attend op: plans in, per-layer op inputs out.

``ForwardCall`` prepares its plans once (all layers share them), batches several rows (both
CFG branches, or several sessions) into one attention call, and hands every layer a
``kernels.fused.LayerInputs`` whose tensors are built once per forward. The layer index and
the first block to restage are 0-dim CPU tensors, made once per layer and per forward, so one
compiled graph serves every layer and every forward.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch
from torch import Tensor

from kernels.fused import LayerInputs, write_attend
from paging.batch import batch_plans
from paging.cache import PagedKVCache
from paging.plan import ForwardPlan


class ForwardCall:
    """The attention side of one forward of one or more plans of ``cache``.

    With one plan and a staging cache, each layer restages from the plan's staging decision
    (only the current chunk's blocks when the history is unchanged); a batch of several rows
    attends straight over the paged cache. ``exact_window`` in the config hands attention the
    plans' ``key_gap``, so it reads exactly the sink and the recent range.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        plans: ForwardPlan | SequenceOf[ForwardPlan],
        *,
        softmax_scale: float,
    ) -> None:
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        plans = [plans] if isinstance(plans, ForwardPlan) else list(plans)
        for i, plan in enumerate(plans):
            if not isinstance(plan, ForwardPlan):
                raise TypeError(f"plans[{i}] must be a ForwardPlan, got {type(plan).__name__}")
            if plan.cache is not cache:
                raise ValueError(f"plans[{i}] belongs to another cache")
        if not isinstance(softmax_scale, float):
            raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
        for plan in plans:
            plan.prepare()
        self.cache = cache
        self.plans = plans
        self.inputs = plans[0].inputs if len(plans) == 1 else batch_plans(plans)
        staged = cache.staging is not None and len(plans) == 1
        stage_from = plans[0].stage_from if staged else -1
        self._stage_from = torch.tensor(stage_from)
        self._layers = [torch.tensor(i) for i in range(cache.num_layers)]
        self._key_gap = self.inputs.key_gap if self.inputs.exact_window else None
        self._softmax_scale = softmax_scale

    @property
    def stage_from(self) -> int:
        """First visible block each layer restages; -1 when attending over the paged cache."""
        return int(self._stage_from)

    def layer(self, index: int) -> LayerInputs:
        """The fused op's inputs for layer ``index``."""
        inputs = self.inputs
        return LayerInputs(
            layer=self._layers[index],
            video_slots=inputs.video_slots,
            action_slots=inputs.action_slots,
            block_table=inputs.block_table,
            cu_seqlens_q=inputs.cu_seqlens_q,
            seq_lens_k=inputs.seq_lens_k,
            key_gap=self._key_gap,
            stage_from=self._stage_from,
            max_seqlen_q=inputs.max_seqlen_q,
            softmax_scale=self._softmax_scale,
        )

    def attend(
        self,
        index: int,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        action_key: Tensor | None = None,
        action_value: Tensor | None = None,
    ) -> Tensor:
        """Write layer ``index``'s K/V (video, then action; packed in plan order) and attend."""
        if action_key is None or action_value is None:
            action_key, action_value = key[:0], value[:0]
        cache = self.cache
        return write_attend(
            query,
            key,
            value,
            action_key,
            action_value,
            cache.k_pools,
            cache.v_pools,
            cache.stage_k,
            cache.stage_v,
            self.layer(index),
        )

    def commit(self) -> None:
        """After the forward ran on every layer: commit each committing plan."""
        for plan in self.plans:
            plan.commit()
