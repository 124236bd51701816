"""A model-like driver of a ``PagedKVCache`` that checks every forward against the window oracle.

``Rollout`` writes each forward's K/V where its plan says (as ``write_slots`` would), mirrors
every write in a ``SlotLedger`` keyed by token identity, and then checks the plan slot by slot:
each key the attention reads must hold exactly the token the oracle's model position implies,
from the forward that wrote it last. Tokens are ``(kind, session, branch, index, writer)``
tuples, ``session`` and ``writer`` being the session and the serial number of the forward that
wrote them: a fork's history holds its parent's tokens. The cache's block copies
(copy-on-write) are mirrored in the ledger, and no forward may write into a block another
sequence holds.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor

from paged_video import paging, reference
from paged_video.kernels import paged_attention as kernel_attention
from paged_video.paging import NULL_BLOCK, ForwardPlan, PagedKVCache, PagingConfig, Session, window
from paged_video.reference import SlotLedger, WindowGeometry

ATOL = 2e-5
# The kernel runs under Triton's interpreter on CPUs: only forwards this small use it.
KERNEL_PAIRS = 1024


def geometry_of(config: PagingConfig) -> WindowGeometry:
    return WindowGeometry(
        chunk_size=config.chunk_size,
        block_size=config.block_size,
        sink_chunks=config.sink_chunks,
        window_chunks=config.window_chunks,
        reset_at_boundary=config.reset_at_boundary,
    )


class CountingList(list):
    """A block table that counts the entries read through it (indexing, slicing, iterating)."""

    touched = 0

    def __getitem__(self, index):
        self.touched += len(range(*index.indices(len(self)))) if isinstance(index, slice) else 1
        return super().__getitem__(index)

    def __iter__(self):
        self.touched += len(self)
        return super().__iter__()


def snapshot(cache: PagedKVCache) -> tuple:
    """Everything a failed call must leave as it was: free count, reference counts, tables,
    committed state, and the free list in order."""
    pool = cache.pool
    return (
        pool.num_free,
        list(pool._refs),
        {
            (sid, branch): (
                list.copy(seq.block_table),
                seq.committed,
                seq.compacted,
                seq.evicted,
                seq.pending,
            )
            for sid, session in cache.sessions.items()
            for branch, seq in session.sequences.items()
        },
        list(pool._free),
    )


def check_pool(cache: PagedKVCache) -> None:
    """Each block's reference count is the number of tables that hold it (only tables hold
    references), no block is free while referenced nor lost, no table lists a block twice,
    branches never share a block, and the stats add up."""
    pool = cache.pool
    references: Counter[int] = Counter()
    branch_of: dict[int, str] = {}
    for session in cache.sessions.values():
        for branch, seq in session.sequences.items():
            blocks = [block for block in list.copy(seq.block_table) if block != NULL_BLOCK]
            assert len(blocks) == len(set(blocks)), "a table lists a block twice"
            references.update(blocks)
            for block in blocks:
                assert branch_of.setdefault(block, branch) == branch, "branches share a block"
    expected = [0] * (pool.num_blocks + 1)
    for block, count in references.items():
        expected[block] = count
    assert pool._refs == expected
    assert all(pool.refcount(block) == count for block, count in references.items())
    free = set(pool._free)  # the blocks nobody holds, each once
    assert len(free) == len(pool._free) == pool.num_free == pool.num_blocks - len(references)
    assert not free & references.keys() and NULL_BLOCK not in free
    assert pool.num_free + pool.num_held == pool.num_blocks
    assert not pool.is_held(NULL_BLOCK)
    stats = pool.stats()
    assert stats.references == sum(references.values()) and stats.held == len(references)
    assert stats.shared == sum(n > 1 for n in references.values())


def check_own_writes(cache: PagedKVCache, plan: ForwardPlan) -> None:
    """No write of the prepared ``plan`` lands in a block another sequence holds: each pool
    block it writes is in its sequence's table and held by it alone, each other block is one of
    the sequence's own scratch blocks."""
    b, sequence = cache.config.block_size, plan.sequence
    table = set(list.copy(sequence.block_table))
    slots = torch.cat([plan.inputs.video_slots, plan.inputs.action_slots])
    for block in set(slots.div(b, rounding_mode="floor").tolist()):
        if block < cache.first_scratch_block:
            assert block in table, f"plan writes block {block}, not in its table"
            assert cache.pool.refcount(block) == 1, f"plan writes shared block {block}"
        else:
            assert block in sequence.scratch, f"plan writes block {block}, not its scratch"


def resident_model_positions(seq: paging.Sequence, config: PagingConfig) -> list[int]:
    """Model positions the sequence's table still holds live (resident and not dead)."""
    b, s = config.block_size, config.sink_tokens
    positions = []
    for entry, block in enumerate(list.copy(seq.block_table)):
        if block == NULL_BLOCK:
            continue
        for p in range(entry * b, min((entry + 1) * b, seq.committed)):
            if not s <= p < s + seq.evicted:
                positions.append(p if p < s else p + seq.compacted)
    return positions


@dataclass
class ForwardRecord:
    """What one forward wrote and read, for tests to inspect."""

    plan: ForwardPlan
    serial: int
    history: int
    read_tokens: list
    touched: int
    kernel_checked: bool = False


class Rollout:
    """Drive one cache like a model: plan, prepare, write, check; commit after success.

    ``kernel_budget`` forwards (small ones only) attend through the Triton kernel, the rest
    through the float64 gather oracle; forwards with more than ``attention_limit`` query-key
    pairs skip the attention check (the slot-by-slot checks always run).
    """

    def __init__(
        self,
        config: PagingConfig,
        *,
        branches: tuple[str, ...] = ("main",),
        session_capacity: int = 1,
        num_heads: int = 2,
        num_kv_heads: int = 1,
        head_dim: int = 4,
        kernel_budget: int = 0,
        attention_limit: int = 1 << 20,
        seed: int = 0,
    ) -> None:
        self.config = config
        self.geometry = geometry_of(config)
        self.cache = PagedKVCache(
            config,
            num_layers=1,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            session_capacity=session_capacity,
            branches=branches,
            dtype=torch.float32,
        )
        self.cache.k_pools.fill_(float("nan"))
        self.cache.v_pools.fill_(float("nan"))
        self.num_heads = num_heads
        self.ledger = SlotLedger()
        self.values: dict[tuple, tuple[Tensor, Tensor]] = {}
        # (session, branch, model position) -> (session, serial) of the forward that wrote it;
        # a fork's history is looked up in the session it was forked from (``writer``).
        self.writer_of: dict[tuple[int, str, int], tuple[int, int]] = {}
        self.forked_from: dict[int, tuple[int, dict[str, int]]] = {}
        copy_contents = self.cache.pool.copy_contents

        def copy_and_record(source: int, target: int) -> None:
            copy_contents(source, target)
            b = config.block_size
            self.ledger.write(
                range(target * b, (target + 1) * b),
                self.ledger.read(range(source * b, (source + 1) * b)),
            )
            self.copies += 1

        self.cache.pool.copy_contents = copy_and_record
        self.copies = 0
        self.serial = 0
        self.kernel_budget = kernel_budget
        self.attention_limit = attention_limit
        self.width = self.cache.table_width
        # What the staging buffer holds, row by row, as tokens (``gather_blocks`` emulated).
        self.staged: list[tuple | None] = [None] * self.cache.max_seqlen_k
        self.max_seqlen_k = self.cache.max_seqlen_k
        self.generator = torch.Generator().manual_seed(seed)

    # -- driving -------------------------------------------------------------------------
    def open(self) -> Session:
        return self._counting(self.cache.open_session())

    def fork(self, session: Session) -> Session:
        """``cache.fork``; the fork's history holds the parent's tokens."""
        child = self._counting(self.cache.fork(session))
        history = {branch: seq.absolute for branch, seq in session.sequences.items()}
        self.forked_from[child.id] = (session.id, history)
        return child

    def writer(self, sid: int, branch: str, p: int) -> tuple[int, int]:
        """(session, serial) of the forward that wrote model position ``p`` of the sequence."""
        while (sid, branch, p) not in self.writer_of:
            sid, history = self.forked_from[sid]
            assert p < history[branch]
        return self.writer_of[(sid, branch, p)]

    @staticmethod
    def _counting(session: Session) -> Session:
        for seq in session.sequences.values():
            seq.block_table = CountingList(seq.block_table)
        return session

    def forward(
        self,
        session: Session,
        branch: str = "main",
        chunks: int = 1,
        *,
        commit: bool = False,
        actions: int = 0,
        check: bool = True,
    ) -> ForwardRecord:
        """Plan, prepare (twice: idempotent), write K/V, check the plan; no commit yet."""
        n = chunks * self.config.chunk_size
        plan = self.cache.plan(session, branch, n, commit=commit, action_tokens=actions)
        table = session.sequences[branch].block_table
        table.touched = 0
        inputs = plan.prepare()
        touched = table.touched
        assert plan.prepare() is inputs
        check_own_writes(self.cache, plan)
        self.serial += 1
        video = [("video", session.id, branch, plan.history + t, self.serial) for t in range(n)]
        action = [("action", session.id, branch, j, self.serial) for j in range(actions)]
        self._write(inputs.video_slots, video)
        self._write(inputs.action_slots, action)
        record = ForwardRecord(plan, self.serial, plan.history, [], touched)
        if check:
            self.check(record)
        return record

    def commit(self, record: ForwardRecord) -> bool:
        plan = record.plan
        committed = plan.commit()
        if committed:
            for p in range(plan.history, plan.history + plan.num_tokens):
                self.writer_of[(plan.session.id, plan.branch, p)] = (plan.session.id, record.serial)
        return committed

    def step(self, session: Session, branch: str = "main", chunks: int = 1, **kwargs):
        """One committing forward, committed."""
        record = self.forward(session, branch, chunks, commit=True, **kwargs)
        assert self.commit(record)
        return record

    def _write(self, slots: Tensor, tokens: list[tuple]) -> None:
        shape = (len(tokens), *self.cache.k_pools.shape[3:])
        k = torch.randn(shape, generator=self.generator)
        v = torch.randn(shape, generator=self.generator)
        layer = self.cache.layer(0)
        layer.k_flat[slots] = k
        layer.v_flat[slots] = v
        self.ledger.write(slots.tolist(), tokens)
        for i, token in enumerate(tokens):
            self.values[token] = (k[i], v[i])

    # -- checking ------------------------------------------------------------------------
    def expected_tokens(self, record: ForwardRecord) -> list[tuple]:
        """The tokens the oracle says the forward reads, in key order (actions last)."""
        plan = record.plan
        sid, branch, h = plan.session.id, plan.branch, record.history
        video = []
        for p in reference.block_read_positions(self.geometry, h, plan.num_tokens):
            writer = (sid, record.serial) if p >= h else self.writer(sid, branch, p)
            video.append(("video", writer[0], branch, p, writer[1]))
        actions = [("action", sid, branch, j, record.serial) for j in range(plan.action_tokens)]
        return video + actions

    def check(self, record: ForwardRecord) -> None:
        plan, inputs = record.plan, record.plan.inputs
        b, n, actions = self.config.block_size, plan.num_tokens, plan.action_tokens
        row = inputs.block_table[0].tolist()
        seq_len = int(inputs.seq_lens_k[0])
        slots = reference.slots_read(row, seq_len, b)
        tokens = self.ledger.read(slots)
        record.read_tokens = tokens

        # Fixed shapes, and the lengths that go with them.
        assert inputs.block_table.shape == (1, self.width) and self.width == self.cache.table_width
        assert inputs.block_table.dtype == torch.int32
        assert inputs.max_seqlen_k == self.max_seqlen_k == self.width * b
        assert 0 < seq_len <= inputs.max_seqlen_k
        assert inputs.cu_seqlens_q.tolist() == [0, n] and inputs.max_seqlen_q == n
        assert all(block == NULL_BLOCK for block in row[math.ceil(seq_len / b) :])
        assert inputs.video_slots.shape == (n,) and inputs.action_slots.shape == (actions,)

        # No unwritten slot is read, and every read slot holds the token its position implies.
        assert None not in tokens, f"unwritten slot read at key {tokens.index(None)}"
        layer = self.cache.layer(0)
        assert not torch.isnan(layer.k_flat[slots]).any()
        assert not torch.isnan(layer.v_flat[slots]).any()
        assert tokens == self.expected_tokens(record)

        # Every kept token is read; at most B - 1 extra tokens per boundary.
        kept = reference.kept_positions(self.geometry, record.history, n)
        read = [token[3] for token in tokens[: seq_len - actions]]
        assert read == sorted(read) and set(kept) <= set(read)
        extras = set(read) - set(kept)
        sink_excess = {p for p in extras if p < math.ceil(self.config.sink_tokens / b) * b}
        assert len(sink_excess) <= b - 1 and len(extras - sink_excess) <= b - 1

        # key_gap: the reads minus the gap are exactly the kept tokens.
        lo, hi = inputs.key_gap[0].tolist()
        assert 0 <= lo <= hi <= seq_len - actions
        assert read[:lo] + read[hi:] == kept

        # Finding the blocks touched only the table entries that can hold kept tokens, and a
        # partly filled tail block once more (whether a fork shares it).
        h, end = record.history, record.history + n
        visible = math.ceil(len(read) / b)
        scratch_video = 0 if plan.committing else math.ceil(end / b) - math.ceil(h / b)
        assert record.touched == visible - scratch_video + (h % b != 0)
        assert visible <= window.max_video_blocks(self.config)

        if plan.staging is not None:
            self.check_staging(record, row, tokens)
        if n * seq_len <= self.attention_limit:
            self.check_attention(record, tokens, (lo, hi))

    def check_staging(self, record: ForwardRecord, row: list[int], tokens: list) -> None:
        """Restage as the fused op would: from ``first_block`` when the layer's tag is the
        plan's history, else from 0, then record the tag. The buffer must then hold exactly
        the keys the forward reads, so a wrongly kept history cannot pass."""
        b, staging = self.config.block_size, record.plan.staging
        assert staging.num_blocks == math.ceil(len(tokens) / b)
        assert 0 <= staging.first_block < staging.num_blocks
        tags = self.cache.stage_tags
        first = staging.first_block if int(tags[0]) == staging.key else 0
        assert record.plan.stage_from == first  # nothing ran between prepare and now
        for j in range(first, staging.num_blocks):
            self.staged[j * b : (j + 1) * b] = self.ledger.read(range(row[j] * b, (row[j] + 1) * b))
        tags[0] = staging.key
        assert self.staged[: len(tokens)] == tokens

    def check_attention(self, record: ForwardRecord, tokens: list, gap: tuple[int, int]) -> None:
        """End to end: attention over the pool equals dense attention over the oracle's keys."""
        inputs = record.plan.inputs
        keep = list(range(len(tokens)))
        if inputs.exact_window:
            keep = [j for j in keep if not gap[0] <= j < gap[1]]
        keys = torch.stack([self.values[tokens[j]][0] for j in keep])
        values = torch.stack([self.values[tokens[j]][1] for j in keep])
        q = torch.randn(
            record.plan.num_tokens, self.num_heads, keys.shape[-1], generator=self.generator
        )
        want = reference.dense_attention(q, keys, values)
        layer = self.cache.layer(0)
        use_kernel = self.kernel_budget > 0 and len(tokens) * q.shape[0] <= KERNEL_PAIRS
        attend = kernel_attention if use_kernel else reference.paged_attention
        got = attend(q, layer.k, layer.v, **inputs.attention_kwargs())
        record.kernel_checked = use_kernel
        self.kernel_budget -= use_kernel
        assert not torch.isnan(got).any()
        assert torch.allclose(got.double(), want, atol=ATOL, rtol=0)

    # -- whole-cache invariants ----------------------------------------------------------
    def check_pool(self) -> None:
        check_pool(self.cache)

    def check_residency(self) -> None:
        """Each sequence holds exactly the oracle's resident positions, each with its token."""
        config, b = self.config, self.config.block_size
        bound = window.blocks_per_sequence(config) + window.compaction_unit(config) // b - 1
        for session in self.cache.sessions.values():
            for branch, seq in session.sequences.items():
                if seq.pending is not None:
                    continue
                assert seq.committed + seq.compacted == seq.absolute
                assert seq.completed_chunks * config.chunk_size == seq.absolute
                assert len(seq.block_table) == seq.history_entries
                if config.compaction:
                    assert len(seq.block_table) <= bound
                positions = resident_model_positions(seq, config)
                assert positions == reference.resident_positions(self.geometry, seq.absolute)
                self.check_resident_tokens(session, branch, seq, positions)

    def check_resident_tokens(self, session, branch, seq, positions) -> None:
        b, s = self.config.block_size, self.config.sink_tokens
        table = list.copy(seq.block_table)
        for p in positions:
            storage = p if p < s else p - seq.compacted
            slot = table[storage // b] * b + storage % b
            writer, serial = self.writer(session.id, branch, p)
            assert self.ledger.read([slot]) == [("video", writer, branch, p, serial)]
