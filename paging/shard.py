"""A sequence-sharded window: one rank's share of the single-process paged layout.

A window longer than one GPU holds is split over the ``degree`` ranks of a shard group. Every
rank keeps the single-process bookkeeping, unchanged (sessions, block tables, eviction,
compaction, scratch and action placement, staging decisions: ``PagedKVCache``'s own code, so
the ranks' plans are identical and their digests comparable), and rank ``index`` *stores* only
the blocks whose first model position ``p`` has ``(p // B) % degree == index``: round-robin by
block along the video. Each attention call reads, on each rank, the rank's blocks of the
single-process row, so the ranks' key sets partition the single process's exactly and their
partial attentions merge (by log-sum-exp) into the single process's attention.

Why by block of the single-process layout rather than by frame:

* every paging rule is the single-process rule itself; a rank only filters its row. Whole-block
  reads add the same boundary tokens as one process would (up to ``B - 1`` at the sink's end and
  at the recent range's start, masked by ``key_gap`` with ``exact_window``), so the merged key
  set is the single process's in every mode, not only with an exact window;
* a rank holding every N-th *frame* packs them into its own blocks, whose boundaries are not the
  single process's: its whole-block reads would add other out-of-window tokens, and the number
  of its frames inside the window would change as the window slides (a per-rank eviction rule);
* ownership is fixed by model position, so compaction (which renumbers table entries) never
  moves a block, and eviction (whole blocks, oldest first) frees the ranks' blocks in turn: the
  sink, the window and the current chunk are balanced to within one block per rank and
  sequence. With ``B = C`` (a block per frame) this *is* round-robin by frame.

Storage per rank: ``ceil(sink_blocks / N) + ceil(other_blocks / N)`` pool blocks per sequence
(the single process's ``window.blocks_per_sequence``, split the same way), and a scratch lane
of ``ceil(lane / N)`` blocks per sequence: a rank's blocks of a forward's scratch entries
(a contiguous run) take its lane's blocks in order, afresh each forward. The block ids of the
plans are the single process's (``num_blocks`` of them, bookkeeping only); the pools hold
``storage_blocks`` physical blocks, and a plan's blocks get physical ones when a rank first
sees them (the committing forward that writes them) and give them back when the single-process
pool frees them.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch
from torch import Tensor

from paged_video.kernels.fused import LayerInputs
from paged_video.paging import window
from paged_video.paging._validate import require_int
from paged_video.paging.cache import PagedKVCache
from paged_video.paging.config import PagingConfig
from paged_video.paging.forward import ForwardCall
from paged_video.paging.plan import AttentionInputs, ForwardPlan, PlanState
from paged_video.paging.pool import BlockPool
from paged_video.paging.session import Session
from paged_video.paging.transfer import to_device


def _share(blocks: int, degree: int) -> int:
    """The most blocks of a contiguous run of ``blocks`` one of ``degree`` ranks owns."""
    return -(-blocks // degree)


class _ReleasingPool(BlockPool):
    """The single-process block pool; a block nobody holds any more also frees its physical
    block. It copies no block contents: a sharded cache forks no sessions."""

    def __init__(self, num_blocks: int, release) -> None:
        super().__init__(num_blocks)
        self._release = release

    def free(self, blocks) -> None:
        blocks = list(blocks)
        super().free(blocks)
        self._release([block for block in dict.fromkeys(blocks) if not self.is_held(block)])


@dataclass(frozen=True)
class LocalRow:
    """One plan's row as a shard rank reads it (host values).

    ``blocks``: physical ids of the rank's blocks of the row, in key order; ``seq_len``: keys
    they hold; ``key_gap``: ``(lo, hi)`` of local keys hidden by the single-process gap;
    ``video_slots`` / ``action_slots`` (int64): the physical slot of each token the rank stores,
    ``-1`` for the others'; ``stage_from``: the rank's first block to restage when its buffers
    hold the forward's history (None without staging).
    """

    blocks: list[int]
    seq_len: int
    key_gap: tuple[int, int]
    video_slots: Tensor
    action_slots: Tensor
    stage_from: int | None


class ShardedKVCache(PagedKVCache):
    """The single-process ``PagedKVCache`` bookkeeping, with pools for one shard's blocks.

    ``shard_degree`` ranks share the window; this one is ``shard_index``. ``plan``,
    sessions and the pool (``pool``, ``num_blocks``) are the single process's: every rank builds
    the same plans. The pools (``k_pools`` ..., ``storage_blocks`` blocks) hold this rank's
    blocks only; ``table_width`` is the width of this rank's rows. ``ShardedForwardCall`` hands
    the fused op this rank's share of each forward.
    """

    def __init__(
        self,
        config: PagingConfig,
        *,
        shard_degree: int,
        shard_index: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        session_capacity: int = 1,
        branches: SequenceOf[str] = ("main",),
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        pool_blocks: int | None = None,
    ) -> None:
        if pool_blocks is not None:
            raise ValueError(
                "pool_blocks: a sequence-sharded cache sizes its pools from session_capacity"
            )
        require_int("shard_degree", shard_degree, minimum=1)
        require_int("shard_index", shard_index, minimum=0)
        if shard_index >= shard_degree:
            raise ValueError(
                f"shard_index must be < shard_degree ({shard_degree}), got {shard_index}"
            )
        self.shard_degree = shard_degree
        self.shard_index = shard_index
        super().__init__(
            config,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            session_capacity=session_capacity,
            branches=branches,
            dtype=dtype,
            device=device,
        )
        self.pool = _ReleasingPool(self.pool.num_blocks, self._release)
        # Single-process pool block -> this rank's physical block, for the blocks it owns.
        self._physical: dict[int, int] = {}

    def fork(self, session: Session) -> Session:
        """Refused: forked sessions on a sequence-sharded window are not built."""
        raise ValueError("session: a sequence-sharded cache does not fork sessions")

    def _allocate(self, shape: tuple[int, ...], kv_dtype: torch.dtype) -> None:
        """Size the physical pools for this rank's share, then allocate them."""
        config, degree = self.config, self.shard_degree
        sink = window.sink_blocks(config)
        sequences = self.session_capacity * len(self.branches)
        per_sequence = _share(sink, degree) + _share(
            window.blocks_per_sequence(config) - sink, degree
        )
        self.storage_pool = BlockPool(sequences * per_sequence)
        self.local_scratch_lane_blocks = _share(self.scratch_lane_blocks, degree)
        self.first_local_scratch_block = 1 + self.storage_pool.num_blocks
        self.storage_blocks = (
            self.first_local_scratch_block + sequences * self.local_scratch_lane_blocks
        )
        super()._allocate((shape[0], self.storage_blocks, *shape[2:]), kv_dtype)

    @property
    def table_width(self) -> int:
        """Block-table width of this rank's rows: its share of the sink's and the rest's."""
        sink = window.sink_blocks(self.config)
        degree = self.shard_degree
        return _share(sink, degree) + _share(window.table_width(self.config) - sink, degree)

    def owns(self, position: int) -> bool:
        """Whether this rank stores the block starting at model position ``position``."""
        return (position // self.config.block_size) % self.shard_degree == self.shard_index

    def _release(self, blocks: list[int]) -> None:
        for block in blocks:
            physical = self._physical.pop(block, None)
            if physical is not None:
                self.storage_pool.free([physical])

    def _local_scratch(self, session: Session, branch: str) -> range:
        lane = session.lane * len(self.branches) + self.branches.index(branch)
        first = self.first_local_scratch_block + lane * self.local_scratch_lane_blocks
        return range(first, first + self.local_scratch_lane_blocks)

    def project(self, plan: ForwardPlan) -> LocalRow:
        """This rank's share of a prepared plan's row; gives physical blocks to the rank's
        blocks the plan writes for the first time."""
        if plan.cache is not self or plan.state is not PlanState.PREPARED:
            raise ValueError("plan must be a prepared plan of this cache")
        b = self.config.block_size
        host = plan.host_inputs
        seq_len = int(host.seq_lens_k[0])
        count = -(-seq_len // b)
        visible = host.block_table[0, :count].tolist()
        positions = plan.block_positions
        if len(positions) != count:
            raise RuntimeError(f"plan has {len(positions)} block positions for {count} blocks")
        # The row's scratch entries are one contiguous run: this rank's share fits its lane.
        scratch = self._local_scratch(plan.session, plan.branch)
        scratch_used = 0
        local = torch.full((count,), -1, dtype=torch.int64)  # row block -> local index
        blocks: list[int] = []
        for i, (block, position) in enumerate(zip(visible, positions, strict=True)):
            if not self.owns(position):
                continue
            if block >= self.first_scratch_block:
                if scratch_used == len(scratch):
                    raise RuntimeError(f"more scratch blocks than the lane's {len(scratch)}")
                physical = scratch[scratch_used]
                scratch_used += 1
            else:
                physical = self._physical.get(block)
                if physical is None:
                    physical = self._physical[block] = self.storage_pool.allocate(1)[0]
            local[i] = len(blocks)
            blocks.append(physical)
        if len(blocks) > self.table_width:
            raise RuntimeError(f"{len(blocks)} blocks exceed the local width {self.table_width}")
        last = seq_len - (count - 1) * b  # keys of the row's last block (only it is partial)
        local_len = len(blocks) * b - (b - last if count and local[-1] >= 0 else 0)

        def local_keys(keys: Tensor) -> Tensor:
            """Local key index of each row key (-1: another rank's)."""
            index = local[keys // b]
            return torch.where(index >= 0, index * b + keys % b, -1)

        def local_slots(keys: Tensor) -> Tensor:
            index = local[keys // b]
            ids = torch.tensor(blocks + [0], dtype=torch.int64)[index]
            return torch.where(index >= 0, ids * b + keys % b, -1)

        gap_lo, gap_hi = (int(x) for x in host.key_gap[0])
        hidden = local_keys(torch.arange(gap_lo, gap_hi, dtype=torch.int64))
        hidden = hidden[hidden >= 0]
        key_gap = (0, 0)
        if hidden.numel():
            key_gap = (int(hidden[0]), int(hidden[-1]) + 1)
            if key_gap[1] - key_gap[0] != hidden.numel():
                raise RuntimeError(f"the local key gap is not one range: {hidden.tolist()}")
        n, actions = plan.num_tokens, plan.action_tokens
        video_keys = seq_len - actions
        stage_from = None
        if plan.staging is not None:
            stage_from = int((local[: plan.staging.first_block] >= 0).sum())
        return LocalRow(
            blocks=blocks,
            seq_len=local_len,
            key_gap=key_gap,
            video_slots=local_slots(torch.arange(video_keys - n, video_keys, dtype=torch.int64)),
            action_slots=local_slots(torch.arange(video_keys, seq_len, dtype=torch.int64)),
            stage_from=stage_from,
        )

    def local_inputs(
        self, plans: SequenceOf[ForwardPlan], rows: SequenceOf[LocalRow]
    ) -> AttentionInputs:
        """The rows of a forward (in plan order) as this rank's attention tensors, on the
        cache's device (queries: every token of every row, as in the single process)."""
        width, b = self.table_width, self.config.block_size
        table = torch.zeros((len(rows), width), dtype=torch.int32)
        for r, row in enumerate(rows):
            table[r, : len(row.blocks)] = torch.tensor(row.blocks, dtype=torch.int32)
        query_lens = [plan.num_tokens for plan in plans]
        cu_seqlens_q = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(
            0, dtype=torch.int32
        )
        tensors = to_device(
            (
                torch.cat([row.video_slots for row in rows]),
                torch.cat([row.action_slots for row in rows]),
                table,
                cu_seqlens_q,
                torch.tensor([row.seq_len for row in rows], dtype=torch.int32),
                torch.tensor([row.key_gap for row in rows], dtype=torch.int32),
            ),
            self.device,
        )
        return AttentionInputs(
            *tensors,
            max_seqlen_q=max(query_lens),
            max_seqlen_k=width * b,
            exact_window=self.config.exact_window,
        )


class ShardedForwardCall(ForwardCall):
    """``ForwardCall`` on one rank of a sequence-sharded window.

    The plans, ``inputs`` (what digests and records read) and the staging decision are the
    single process's; ``local_inputs`` is this rank's share, and ``layer`` hands the fused op
    that share: the rank's blocks, lengths and key gaps, the slots of the tokens it stores
    (``-1`` for the others', which the write skips) and, with staging, its own first block.
    The queries (and the K/V handed to the op) are every token of every row. A rank's attention
    is partial, so ``layer`` asks the op for the log-sum-exp too: ``attend`` returns
    ``(out, lse)``, to merge with the other ranks' (``merge_stacked_attention_states``).

    A quantized cache's first write of a layer freezes what it chooses (the K mean, then the
    channel equalization factors). The op would choose them from the tokens this rank stores;
    every rank must quantize with the single process's (the partial LSEs merge exactly only
    then), so ``layer`` also hands the op the single process's slots (``choice_slots``): the op
    chooses from every video token of the forward, by the rule ``write_slots`` follows, on every
    rank and whoever calls it (``attend``, or a model's processor with these inputs).
    """

    def __init__(
        self,
        cache: ShardedKVCache,
        plans: ForwardPlan | SequenceOf[ForwardPlan],
        *,
        softmax_scale: float,
    ) -> None:
        if not isinstance(cache, ShardedKVCache):
            raise TypeError(f"cache must be a ShardedKVCache, got {type(cache).__name__}")
        listed = [plans] if isinstance(plans, ForwardPlan) else plans
        if not isinstance(listed, SequenceOf) or isinstance(listed, str):
            listed = []  # the base class refuses it
        # Plans this call prepares: a refused call unprepares them (their blocks go back).
        fresh = [p for p in listed if isinstance(p, ForwardPlan) and p.state is PlanState.NEW]
        super().__init__(cache, plans, softmax_scale=softmax_scale)
        try:
            rows = [cache.project(plan) for plan in self.plans]
            self.local_inputs = cache.local_inputs(self.plans, rows)
        except Exception:
            for plan in reversed(fresh):
                plan.unprepare()
            raise
        # With staging (one row): this rank's first block to restage when its buffers hold the
        # forward's history, where the single process's is its count of history blocks.
        first = rows[0].stage_from
        self._local_stage_from = None if first is None else torch.tensor(first)
        self._key_gap = self.local_inputs.key_gap if self.local_inputs.exact_window else None

    def layer(self, index: int) -> LayerInputs:
        """The fused op's inputs for layer ``index``: this rank's share of the forward, with
        ``return_lse``."""
        local = self.local_inputs
        inputs = super().layer(index)
        staged = self._local_stage_from is not None and int(inputs.stage_from) >= 0
        return inputs._replace(
            video_slots=local.video_slots,
            action_slots=local.action_slots,
            block_table=local.block_table,
            seq_lens_k=local.seq_lens_k,
            stage_from=self._local_stage_from if staged else inputs.stage_from,
            return_lse=True,
            choice_slots=self.inputs.video_slots,
        )
