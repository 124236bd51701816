"""One forward through the fused write+attend op: plans in, per-layer op inputs out.

``ForwardCall`` prepares its plans once (all layers share them), batches several rows (both
CFG branches, or several sessions) into one attention call, and hands every layer a
``kernels.fused.LayerInputs`` whose tensors are built once per forward. The layer index, the
first block to restage and the staged history's id are 0-dim CPU tensors, made once per layer
and per forward, so one compiled graph serves every layer and every forward.

A call refuses (``ValueError``) to run a plan that is no longer current
(``ForwardPlan.check_current``): cancelled, committed, its session closed, its sequence
committed since it was prepared (its tensors would point at blocks that moved or went back to
the pool), behind another committing forward pending on its sequence, or the tail block it
writes into copied or shared by a fork since (it would write into a block another session
holds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence as SequenceOf

import torch
from torch import Tensor

from paged_video.kernels._checks import check_tensor
from paged_video.kernels.fused import LayerInputs, write_attend
from paged_video.paging.batch import batch_plans
from paged_video.paging.cache import PagedKVCache
from paged_video.paging.plan import ForwardPlan, PlanState
from paged_video.paging.staging import NOTHING_STAGED


class ForwardCall:
    """The attention side of one forward of one or more plans of ``cache``.

    With one plan and a staging cache, each layer restages (only the current chunk's blocks when
    its buffers still hold this forward's history, else everything); a batch of several rows
    attends straight over the paged cache and leaves nothing reusable staged. ``exact_window``
    in the config hands attention the plans' ``key_gap``, so it reads exactly the sink and the
    recent range. Making the call prepares its plans; if that or batching them fails, the plans
    this call prepared are unprepared again, so a refused call changes nothing: the device
    copies of shared tail blocks (copy-on-write) are made only once every plan passed.
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
        if isinstance(plans, ForwardPlan):
            plans = [plans]
        elif isinstance(plans, SequenceOf) and not isinstance(plans, str):
            plans = list(plans)
        else:
            raise TypeError(
                f"plans must be a ForwardPlan or a sequence of them, got {type(plans).__name__}"
            )
        for i, plan in enumerate(plans):
            if not isinstance(plan, ForwardPlan):
                raise TypeError(f"plans[{i}] must be a ForwardPlan, got {type(plan).__name__}")
            if plan.cache is not cache:
                raise ValueError(f"plans[{i}] belongs to another cache")
        if not isinstance(softmax_scale, float):
            raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
        if not math.isfinite(softmax_scale):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
        cache.check_layer_state()  # never attend codes written under an unchosen mean/factors
        self.cache = cache
        self.plans = plans
        fresh = list({id(plan): plan for plan in plans if plan.state is PlanState.NEW}.values())
        try:
            for i, plan in enumerate(plans):
                if plan.state is not PlanState.NEW:
                    plan.check_current(f"plans[{i}]")
                plan._prepare(copy_tail=False)  # the copies below, once every plan passed
            # batch_plans checks every plan again once all are prepared: a committing plan
            # prepared after a scratch plan of its sequence leaves that one behind it.
            self.inputs = plans[0].inputs if len(plans) == 1 else batch_plans(plans)
        except Exception:
            for plan in reversed(fresh):
                plan.unprepare()
            raise
        for plan in plans:  # checked: now the copies of shared tail blocks (copy-on-write)
            plan._copy_tail_block()
        decision = plans[0].staging if cache.staging is not None and len(plans) == 1 else None
        self._staged = decision is not None
        # The op's stage_from: where a layer restages from when its buffers hold this history.
        self._keep_from = torch.tensor(-1 if decision is None else decision.first_block)
        self._restaged_from: int | None = None  # recorded when the first layer's inputs are taken
        self._stage_key = torch.tensor(
            NOTHING_STAGED if decision is None else decision.key, dtype=torch.int64
        )
        self._layers = [torch.tensor(i) for i in range(cache.num_layers)]
        self._key_gap = self.inputs.key_gap if self.inputs.exact_window else None
        self._softmax_scale = softmax_scale

    @property
    def stage_from(self) -> int:
        """Where this forward restages from, as ``ForwardPlan.stage_from`` says it: the first
        visible block some layer restages, -1 when attending over the paged cache.

        Fixed when the first layer's inputs are taken (``layer``, ``attend``), before any layer
        runs, from what the staging buffers hold then; until then, from what they hold now.
        """
        if self._restaged_from is not None:
            return self._restaged_from
        if not self._staged:
            return -1
        return self.cache.staging.first_block(self.plans[0].staging)

    def check_current(self) -> None:
        """``ValueError`` unless every plan may still run (``ForwardPlan.check_current``)."""
        for i, plan in enumerate(self.plans):
            plan.check_current(f"plans[{i}]")

    def _check_index(self, index: object) -> int:
        layers = self.cache.num_layers
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"index (the layer) must be an int, got {type(index).__name__}")
        if not 0 <= index < layers:
            raise ValueError(
                f"index (the layer) must be in 0..{layers - 1} (num_layers={layers}), got {index}"
            )
        return index

    def layer(self, index: int) -> LayerInputs:
        """The fused op's inputs for layer ``index``."""
        index = self._check_index(index)
        self.check_current()
        if self._restaged_from is None:
            staged = self._staged
            self._restaged_from = min(plan.start_forward(staged=staged) for plan in self.plans)
        inputs = self.inputs
        return LayerInputs(
            layer=self._layers[index],
            video_slots=inputs.video_slots,
            action_slots=inputs.action_slots,
            block_table=inputs.block_table,
            cu_seqlens_q=inputs.cu_seqlens_q,
            seq_lens_k=inputs.seq_lens_k,
            key_gap=self._key_gap,
            stage_from=self._keep_from,
            stage_key=self._stage_key,
            stage_tags=self.cache.stage_tags,
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
        """Write layer ``index``'s K/V (video, then action; packed in plan order) and attend.

        Every argument is checked before anything is written: a refused call changes nothing.
        """
        layer = self.layer(index)
        check_tensor("key", key)
        check_tensor("value", value)
        if (action_key is None) != (action_value is None):
            raise ValueError("action_key and action_value must be given together (or neither)")
        if action_key is None:
            action_key, action_value = key[:0], value[:0]
        return write_attend(
            query, key, value, action_key, action_value, self.cache.pool_tensors, layer
        )

    def commit(self) -> None:
        """After the forward ran on every layer: commit each committing plan."""
        for plan in self.plans:
            plan.commit()
