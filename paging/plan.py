"""Forward plans: where a forward's tokens are written and which blocks its attention reads.

A plan is made for (session, branch, tokens, commit?, action tokens) and does nothing until
``prepare``, which runs once per forward for every layer: it allocates a committing forward's
blocks and builds the fixed-shape tensors the kernels consume. Read positions ("keys") are the
row's logical key coordinates: key ``j`` lives in ``block_table[0, j // B]`` at ``j % B``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from paged_video.paging import window
from paged_video.paging.config import PagingConfig
from paged_video.paging.session import Sequence, Session, TailWrite
from paged_video.paging.staging import HistoryStaging, StagingDecision
from paged_video.paging.transfer import to_device


@dataclass(frozen=True)
class AttentionInputs:
    """The tensors of one attention call over the cache, one row per sequence.

    The queries are the rows' video tokens, packed in row order. ``video_slots`` and
    ``action_slots`` (int64) say where each video and action token's K/V is written, in that
    order. ``block_table`` (``(batch, width)`` int32) lists each row's visible blocks, padded
    with the null block; ``cu_seqlens_q`` (``(batch + 1,)``) and ``seq_lens_k`` (``(batch,)``)
    are int32. ``key_gap`` (``(batch, 2)`` int32) is each row's ``[lo, hi)`` of keys that
    whole-block reads add but the window does not keep; ``exact_window`` says whether attention
    is handed it.
    """

    video_slots: Tensor
    action_slots: Tensor
    block_table: Tensor
    cu_seqlens_q: Tensor
    seq_lens_k: Tensor
    key_gap: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    exact_window: bool

    def attention_kwargs(self) -> dict[str, object]:
        """Keyword arguments for ``paged_attention`` after ``q, k_cache, v_cache``."""
        return {
            "block_table": self.block_table,
            "cu_seqlens_q": self.cu_seqlens_q,
            "seq_lens_k": self.seq_lens_k,
            "max_seqlen_q": self.max_seqlen_q,
            "key_gap": self.key_gap if self.exact_window else None,
        }


class PlanState(enum.Enum):
    NEW = "new"
    PREPARED = "prepared"
    COMMITTED = "committed"
    CANCELLED = "cancelled"


class CacheView(Protocol):
    """What a plan reads of the cache that made it (a ``PagedKVCache``): the configuration,
    the device its tensors go to, the staging record (None without staging) and whether its
    layers' first-write state may be written under (``check_layer_state``)."""

    @property
    def config(self) -> PagingConfig: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def staging(self) -> HistoryStaging | None: ...
    def check_layer_state(self) -> None: ...


class ForwardPlan:
    """One forward of one sequence; made by ``PagedKVCache.plan``, which validates it.

    A *committing* forward writes its video after the history into the session's own blocks;
    a *scratch* forward continues the history's tail block when it is partly filled and then
    uses the sequence's scratch blocks, and changes no committed state. Action tokens continue
    the read right after the video: in the free tail of the video's last block, then in scratch
    blocks after the video's (a committing forward's from scratch block 0).

    Either kind writes into the partly filled tail block, so when a fork shares that block,
    ``prepare`` first gives the sequence its own copy (``Sequence.own_tail``, a device copy of
    the block's K/V and scales on every layer): in a batched launch every row writes before any
    attends, so two forks writing the free slots of one block would read each other's tokens.
    ``tail`` is that write (None on a block edge).

    A prepared plan hands out its tensors (``prepare``, ``batch_plans``, ``ForwardCall``) only
    while it is current (``check_current``): any commit on its sequence since ``prepare``
    overtakes it, since eviction may have returned the blocks its table lists to the pool, and
    so does a fork or copy that leaves the tail block it writes into shared or no longer its.
    """

    def __init__(
        self,
        cache: CacheView,
        session: Session,
        branch: str,
        num_tokens: int,
        *,
        committing: bool,
        action_tokens: int,
    ) -> None:
        self.cache = cache
        self.session = session
        self.branch = branch
        self.num_tokens = num_tokens
        self.committing = committing
        self.action_tokens = action_tokens
        self.state = PlanState.NEW
        self.inputs: AttentionInputs | None = None
        self.staging: StagingDecision | None = None
        # Model positions committed before this forward (its first token's position), and the
        # sequence's generation (its count of commits) then.
        self.history: int | None = None
        self.generation: int | None = None
        self.tail: TailWrite | None = None
        self._tail_copied = True
        self._stage_from = -1
        # ``inputs`` as built on the host, and the model position where each block of its
        # table row starts (video blocks, then action blocks): what a sequence-sharded window
        # (``paging.shard``) lays out again for each rank's share of the blocks.
        self.host_inputs: AttentionInputs | None = None
        self.block_positions: list[int] | None = None

    @property
    def sequence(self) -> Sequence:
        return self.session.sequences[self.branch]

    @property
    def stage_from(self) -> int:
        """Where this plan's forward restages from: the first visible block some layer
        restages (a layer whose buffers hold this history keeps the blocks before
        ``staging.first_block``; any other restages all); -1 when it attends over the paged
        cache (no staging, or a batch of rows).

        Read from the staging record when the plan is prepared, and again when a
        ``ForwardCall`` over it starts (``start_forward``), so after a forward it says where
        that forward's layers restaged from; ``ForwardCall.stage_from`` is the same figure.
        """
        return self._stage_from

    def start_forward(self, *, staged: bool) -> int:
        """Record (and return) where a forward over this plan that starts now restages from:
        -1 unless ``staged`` (one row over a staging cache), else from the staging record."""
        if not staged or self.staging is None:
            self._stage_from = -1
        else:
            self._stage_from = self.cache.staging.first_block(self.staging)
        return self._stage_from

    def _check_session(self, name: str) -> None:
        if self.session.closed:
            raise ValueError(
                f"{name}: session {self.session.id} is not open (it was closed); plan forwards "
                "of an open session"
            )

    def check_current(self, name: str = "plan") -> None:
        """``ValueError`` (naming the plan ``name``) unless the plan may hand out its tensors:
        prepared, neither committed nor cancelled, its session open, its sequence not
        committed since ``prepare`` (same generation), the tail block it writes still its
        sequence's alone (no fork shares it, no copy replaced it) and no other committing
        forward pending on it (whose tail block this forward would write)."""
        if self.state is not PlanState.PREPARED:
            if self.state is PlanState.NEW:
                raise ValueError(f"{name} is not prepared; call prepare() first")
            raise ValueError(f"{name} is {self.state.value}; make a new plan")
        self._check_session(name)
        sequence = self.sequence
        if sequence.generation != self.generation:
            commits = sequence.generation - self.generation
            raise ValueError(
                f"{name} is stale: overtaken by {commits} commit(s) on branch {self.branch!r} "
                f"of session {self.session.id} since it was prepared (history {self.history} -> "
                f"{sequence.absolute} tokens), which may have freed its blocks; make a new plan"
            )
        tail = self.tail
        if tail is not None and not sequence.holds_alone(tail.entry, tail.block):
            raise ValueError(
                f"{name} is stale: the tail block it writes into was copied or shared by a fork "
                "since it was prepared; make a new plan"
            )
        if sequence.pending is not None and sequence.pending is not self:
            raise ValueError(
                f"{name}: a committing forward is pending on branch {self.branch!r} of session "
                f"{self.session.id}; commit or cancel it first"
            )

    def prepare(self) -> AttentionInputs:
        """Allocate (committing forward) and build the tensors; later calls return the same.

        Only while the plan is current (``check_current``): a cancelled, committed or
        overtaken plan refuses, whatever happened before, since its blocks may be free again.
        Nor over a quantized cache whose committed tokens were written before a layer's mean
        or factors were chosen (``PagedKVCache.check_layer_state``).
        """
        self.cache.check_layer_state()
        return self._prepare(copy_tail=True)

    def _prepare(self, *, copy_tail: bool) -> AttentionInputs:
        """``prepare``; ``copy_tail=False`` (``ForwardCall`` only) leaves a shared tail block's
        device copy to ``_copy_tail_block``, which the call runs once it has checked every
        plan (or it unprepares them), so a refused call writes no byte."""
        if self.state is not PlanState.NEW:
            self.check_current()
            return self.inputs
        self._check_session("plan")
        sequence = self.sequence
        if sequence.pending is not None:
            raise ValueError(
                f"plan: a committing forward is pending on branch {self.branch!r} of session "
                f"{self.session.id}; commit or cancel it before preparing another forward"
            )
        self.inputs = self._build(sequence)
        self.history = sequence.absolute
        self.generation = sequence.generation
        self.state = PlanState.PREPARED
        self._tail_copied = self.tail is None or self.tail.replaced is None
        if copy_tail:
            self._copy_tail_block()
        return self.inputs

    def _copy_tail_block(self) -> None:
        """The device copy of the shared tail block ``prepare`` replaced, once."""
        if not self._tail_copied:
            self.sequence.pool.copy_contents(self.tail.replaced, self.tail.block)
            self._tail_copied = True

    def unprepare(self) -> None:
        """Undo ``prepare`` of a plan that never ran (a call refused right after preparing it):
        blocks back, a tail copy undone, state new."""
        if self.state is not PlanState.PREPARED:
            return
        if not self.session.closed:
            if self.committing:
                self.sequence.drop_pending()
            if self.tail is not None:
                self.sequence.restore_tail(self.tail)
        self.inputs, self.staging, self.history, self.generation = None, None, None, None
        self.host_inputs, self.block_positions = None, None
        self.tail, self._tail_copied = None, True
        self._stage_from = -1
        self.state = PlanState.NEW

    def _build(self, sequence: Sequence) -> AttentionInputs:
        config = self.cache.config
        b = config.block_size
        n, actions = self.num_tokens, self.action_tokens
        history = sequence.committed
        end = history + n
        last_entry = -(-end // b)
        if self.committing:
            self.tail = sequence.begin(self, n)
            table_entries = last_entry
        else:
            self.tail = sequence.own_tail()
            table_entries = sequence.history_entries
        scratch = sequence.scratch

        def blocks(first: int, stop: int) -> list[int]:
            """Block ids of entries ``[first, stop)``: the table's, then scratch blocks."""
            from_table = sequence.block_table[first : min(stop, table_entries)]
            lo, hi = max(first, table_entries) - table_entries, max(0, stop - table_entries)
            return from_table + list(scratch[lo:hi])

        # Every resident block holding a kept token, in position order: the sink's, then the
        # recent range's from the block where it starts; the two may share a block.
        sink_end = min(config.sink_tokens, end)
        sink_entries = -(-sink_end // b)
        recent = window.recent_start(config, end, sequence.evicted)
        first_recent = max(recent // b, sink_entries)
        visible = blocks(0, sink_entries) + blocks(first_recent, last_entry)
        video_keys = len(visible) * b - (last_entry * b - end)
        video_blocks = len(visible)

        spill = max(0, actions - (-video_keys % b))
        first_action = last_entry - table_entries
        action_entries = -(-spill // b)
        visible += scratch[first_action : first_action + action_entries]
        seq_len = video_keys + actions
        # Entry e holds storage positions [e*B, (e+1)*B): model positions too in the sink's
        # entries, shifted by what compaction removed after them (scratch entries continue).
        entries = [
            *range(sink_entries),
            *range(first_recent, last_entry),
            *range(last_entry, last_entry + action_entries),
        ]
        first_after_sink = window.sink_blocks(config)
        self.block_positions = [
            e * b + (sequence.compacted if e >= first_after_sink else 0) for e in entries
        ]

        if sink_end < recent < end:
            gap_end = recent if recent // b < sink_entries else sink_entries * b + recent % b
        else:
            gap_end = sink_end

        width = window.table_width(config)
        table = torch.zeros((1, width), dtype=torch.int32)
        table[0, : len(visible)] = torch.tensor(visible, dtype=torch.int32)
        keys = torch.arange(video_keys - n, seq_len)
        slots = table[0].to(torch.int64)[keys // b] * b + keys % b
        video_slots, action_slots = slots[:n], slots[n:]

        if self.cache.staging is not None:
            self.staging = self._decide_staging(sequence, visible, video_blocks, seq_len)
        host = (
            video_slots,
            action_slots,
            table,
            torch.tensor([0, n], dtype=torch.int32),
            torch.tensor([seq_len], dtype=torch.int32),
            torch.tensor([[sink_end, gap_end]], dtype=torch.int32),
        )
        sizes = {"max_seqlen_q": n, "max_seqlen_k": width * b, "exact_window": config.exact_window}
        self.host_inputs = AttentionInputs(*host, **sizes)
        # One asynchronous copy for all of them: preparing never waits for the GPU.
        return AttentionInputs(*to_device(host, self.cache.device), **sizes)

    def _decide_staging(
        self, sequence: Sequence, visible: list[int], video_blocks: int, seq_len: int
    ) -> StagingDecision:
        """Keep the staged history when nothing but this forward's own blocks can differ.

        Records nothing: the fused op records what each layer's buffers hold once it restaged.
        """
        b = self.cache.config.block_size
        history, end = sequence.committed, sequence.committed + self.num_tokens
        # Visible blocks that hold history only: those before the block the chunk starts in.
        # Their contents change only by a commit, which changes ``absolute``.
        history_blocks = video_blocks - (-(-end // b) - history // b)
        visible_history = tuple(visible[:history_blocks])
        key = (
            self.session.id,
            self.branch,
            sequence.absolute,
            self.num_tokens,
            seq_len,
            visible_history,
        )
        aligned = history % b == 0 and end % b == 0
        staging = self.cache.staging
        decision = staging.decide(
            key,
            reusable=aligned and self.action_tokens == 0,
            history_blocks=history_blocks,
            num_blocks=len(visible),
        )
        self._stage_from = staging.first_block(decision)
        return decision

    def commit(self) -> bool:
        """After a successful committing forward: complete its chunks, evict, compact.

        Returns whether anything was committed: a scratch plan, a plan never prepared, or one
        already committed or cancelled changes nothing.
        """
        if not self.committing or self.state is not PlanState.PREPARED:
            return False
        self._check_session("plan")
        self.sequence.commit(self.num_tokens)
        self.state = PlanState.COMMITTED
        return True

    def cancel(self) -> None:
        """Abandon the plan (e.g. its forward failed): a committing one returns its new blocks."""
        if self.state is PlanState.COMMITTED:
            raise ValueError("plan: already committed; it cannot be cancelled")
        if self.state is PlanState.PREPARED and self.committing and not self.session.closed:
            self.sequence.drop_pending()
        if self.staging is not None:  # only a staging cache decides
            self.cache.staging.forget(self.staging.key)
        self.state = PlanState.CANCELLED
