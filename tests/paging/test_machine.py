"""A stateful hypothesis machine over random geometries, checked after every step.

Every forward is checked slot by slot against the window oracle and the slot ledger (see
``rollout.py``); a shadow cache without compaction runs the same steps and must keep the same
model positions resident. A twin pair of caches (``twin.py``: one staging, one not; float
or int8 pools, drawn per example) runs real ``ForwardCall`` forwards, batched over several
branches and sessions or single-row, among plans prepared and dropped, cancelled, re-prepared
after cancel, overtaken by a commit, and forwards abandoned part way; every output of the
staged cache must equal the unstaged one bit for bit. Its kernels take the plain-PyTorch path
so each step stays cheap (the kernels are checked elsewhere); the plan rules launch nothing.
Runs ``8 x`` the loaded profile's ``max_examples`` (480 under ``--hypothesis-profile=ci``).

Forks: every cache forks sessions (all branches at once) while the twin's unstaged cache makes
deep copies instead, so a fork's outputs must equal its deep-copied twin's bit for bit. Closing
a session closes a fork or a parent alike; ``write_into_shared`` runs forwards where forks'
shared histories end, the forks sharing a tail block batched in one launch. After every step
each block's reference count is the number of tables holding it (``check_pool``), and no
forward ever writes into a block another sequence holds (``check_own_writes``). Refused forks
(mid-forward, beyond ``session_capacity``, of a closed session) change nothing.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from paged_video.paging import PagingConfig, batch_plans
from paged_video.paging.forward import ForwardCall
from tests.paging.rollout import Rollout, check_pool, resident_model_positions, snapshot
from tests.paging.twin import Twin, plain_torch_kernels


@st.composite
def setups(draw) -> tuple[PagingConfig, tuple[str, ...], int, tuple[torch.dtype | None, bool]]:
    block_size = draw(st.integers(1, 64))
    window_chunks = draw(st.integers(1, 4))
    # Chunks of whole blocks are drawn often too: only they let history staging be reused.
    whole_blocks = st.integers(1, max(1, 100 // block_size)).map(lambda k: k * block_size)
    config = PagingConfig(
        block_size=block_size,
        chunk_size=draw(st.integers(1, 100) | whole_blocks),
        sink_chunks=draw(st.integers(0, 3)),
        window_chunks=window_chunks,
        max_forward_chunks=draw(st.integers(1, min(3, window_chunks))),
        max_action_tokens=draw(st.integers(0, block_size + 3)),
        reset_at_boundary=draw(st.booleans()),
        reuse_history_staging=draw(st.booleans()),
        exact_window=draw(st.booleans()),
    )
    branches = draw(st.sampled_from([("main",), ("positive", "negative")]))
    # The twin's pools: float, or codes and scales (the same number of examples either way),
    # slot-major or (quantized) keys-major: copy-on-write, deep copies and staging by strides.
    kv_dtype = draw(st.sampled_from([None, torch.int8]))
    keys_major = kv_dtype is not None and draw(st.booleans())
    return config, branches, draw(st.integers(1, 3)), (kv_dtype, keys_major)


class PagingMachine(RuleBasedStateMachine):
    @initialize(setup=setups())
    def build(self, setup) -> None:
        config, branches, capacity, (kv_dtype, keys_major) = setup
        self.config, self.branches, self.capacity = config, branches, capacity
        # Attention end to end on small forwards only (one through the kernel); the slot-by-slot
        # checks run on every forward.
        self.main = Rollout(
            config,
            branches=branches,
            session_capacity=capacity,
            kernel_budget=1,
            attention_limit=1 << 13,
        )
        shadow_config = dataclasses.replace(config, compaction=False)
        self.shadow = Rollout(
            shadow_config, branches=branches, session_capacity=capacity, attention_limit=0
        )
        self.twin = Twin(
            dataclasses.replace(config, kv_dtype=kv_dtype, keys_major=keys_major),
            branches=branches,
            session_capacity=capacity,
        )
        self.sessions: list[tuple] = []
        self.pending: dict[tuple[int, str], tuple] = {}
        # Twin rows (session index, branch) whose committing plans were prepared and dropped.
        self.twin_pending: dict[tuple[int, str], tuple] = {}
        self.open_session()

    def pick(self, data, row=None):
        pair, branch = row or (
            data.draw(st.sampled_from(self.sessions)),
            data.draw(st.sampled_from(self.branches)),
        )
        chunks = data.draw(st.integers(1, self.config.max_forward_chunks))
        actions = data.draw(st.just(0) | st.integers(0, self.config.max_action_tokens))
        return pair, branch, chunks, actions

    @rule()
    def open_session(self) -> None:
        if len(self.sessions) < self.capacity:
            self.sessions.append((self.main.open(), self.shadow.open()))
            self.twin.open()
            return
        for cache in (self.main.cache, self.shadow.cache, *self.twin.caches):
            before = snapshot(cache)
            with pytest.raises(ValueError, match="session_capacity"):
                cache.open_session()
            assert snapshot(cache) == before

    @rule(data=st.data())
    def close_session(self, data) -> None:
        """Close a session (a fork or a parent alike); when none is left, every block is free
        again: open a new one."""
        self.close_index(data.draw(st.integers(0, len(self.sessions) - 1)))

    def close_index(self, index: int) -> None:
        pair = self.sessions.pop(index)
        self.pending = {key: v for key, v in self.pending.items() if key[0] != pair[0].id}
        for rollout, session in zip((self.main, self.shadow), pair, strict=True):
            rollout.cache.close_session(session)
        self.twin.close(index)
        self.twin_pending = {
            (i - (i > index), branch): plans
            for (i, branch), plans in self.twin_pending.items()
            if i != index
        }
        before = snapshot(self.main.cache)
        with pytest.raises(ValueError, match="not open"):
            self.main.cache.fork(pair[0])
        assert snapshot(self.main.cache) == before
        if not self.sessions:
            for cache in (self.main.cache, self.shadow.cache, *self.twin.caches):
                assert cache.pool.num_free == cache.pool.num_blocks
            self.open_session()

    @rule(data=st.data())
    def fork(self, data) -> None:
        """Fork a session on every cache (the twin's unstaged one deep-copies it); refused,
        changing nothing, while a committing forward is pending or at ``session_capacity``."""
        self.fork_session(data.draw(st.integers(0, len(self.sessions) - 1)))

    def fork_session(self, index: int) -> bool:
        pair, twin_pair = self.sessions[index], self.twin.sessions[index]
        refusals = []
        if any((pair[0].id, branch) in self.pending for branch in self.branches):
            rollouts = (self.main, self.shadow)
            refusals += [(r.cache, s, "mid-forward") for r, s in zip(rollouts, pair, strict=True)]
        if any((index, branch) in self.twin_pending for branch in self.branches):
            refusals.append((self.twin.staged, twin_pair[0], "mid-forward"))
        if not refusals and len(self.sessions) == self.capacity:
            caches = (self.main.cache, self.shadow.cache, *self.twin.caches)
            refusals = [
                (cache, session, "session_capacity")
                for cache, session in zip(caches, (*pair, *twin_pair), strict=True)
            ]
        event(f"fork refused: {refusals[0][2]}" if refusals else "fork")
        for cache, session, match in refusals:
            before = snapshot(cache)
            with pytest.raises(ValueError, match=match):
                cache.fork(session)
            assert snapshot(cache) == before
        if refusals:
            return False
        self.sessions.append((self.main.fork(pair[0]), self.shadow.fork(pair[1])))
        self.twin.fork(index)
        return True

    def forward(self, data, *, commit: bool, row=None) -> None:
        pair, branch, chunks, actions = self.pick(data, row)
        key = (pair[0].id, branch)
        if key in self.pending:
            # A forward on a sequence with a pending committing forward is refused.
            for rollout, session in zip((self.main, self.shadow), pair, strict=True):
                n = chunks * self.config.chunk_size
                plan = rollout.cache.plan(session, branch, n, commit=commit, action_tokens=actions)
                before = snapshot(rollout.cache)
                with pytest.raises(ValueError, match="pending"):
                    plan.prepare()
                assert snapshot(rollout.cache) == before
            return
        records = tuple(
            rollout.forward(session, branch, chunks, commit=commit, actions=actions)
            for rollout, session in zip((self.main, self.shadow), pair, strict=True)
        )
        # With and without compaction the forward reads the same model positions.
        assert [t[:4] for t in records[0].read_tokens] == [t[:4] for t in records[1].read_tokens]
        if commit:
            self.pending[key] = records

    @rule(data=st.data())
    def scratch_forward(self, data) -> None:
        self.forward(data, commit=False)

    @rule(data=st.data())
    def committing_forward(self, data) -> None:
        """A committing forward, left pending for a later ``commit`` or ``cancel`` rule."""
        self.forward(data, commit=True)

    @rule(data=st.data(), forwards=st.integers(1, 6))
    def advance(self, data, forwards: int) -> None:
        """Several committed forwards in a row, so rollouts reach eviction and compaction."""
        for _ in range(forwards):
            pair, branch, chunks, actions = self.pick(data)
            if (pair[0].id, branch) in self.pending:
                continue
            for rollout, session in zip((self.main, self.shadow), pair, strict=True):
                rollout.step(session, branch, chunks, actions=actions)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def commit(self, data) -> None:
        key = data.draw(st.sampled_from(sorted(self.pending)))
        for rollout, record in zip((self.main, self.shadow), self.pending.pop(key), strict=True):
            assert rollout.commit(record)
            assert not rollout.commit(record)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def cancel(self, data) -> None:
        """Cancel a pending committing forward; preparing it again is refused."""
        key = data.draw(st.sampled_from(sorted(self.pending)))
        for rollout, record in zip((self.main, self.shadow), self.pending.pop(key), strict=True):
            record.plan.cancel()
            before = snapshot(rollout.cache)
            with pytest.raises(ValueError, match="cancelled"):
                record.plan.prepare()
            assert snapshot(rollout.cache) == before

    @rule(data=st.data())
    def commit_scratch(self, data) -> None:
        """Committing a scratch plan changes nothing (plan-only: no kernel launch)."""
        pair, branch, chunks, actions = self.pick(data)
        if (pair[0].id, branch) in self.pending:
            return
        for rollout, session in zip((self.main, self.shadow), pair, strict=True):
            n = chunks * self.config.chunk_size
            plan = rollout.cache.plan(session, branch, n, action_tokens=actions)
            plan.prepare()
            before = snapshot(rollout.cache)
            assert plan.commit() is False
            assert snapshot(rollout.cache) == before

    # -- the twin: real forwards, staged against unstaged ---------------------------------
    def twin_rows(self, data, *, max_rows: int) -> list[tuple[int, str]]:
        free = [
            (i, branch)
            for i in range(len(self.sessions))
            for branch in self.branches
            if (i, branch) not in self.twin_pending
        ]
        if not free:
            return []
        rows = st.lists(st.sampled_from(free), min_size=1, max_size=max_rows, unique=True)
        return data.draw(rows)

    @rule(data=st.data())
    def twin_forward(self, data) -> None:
        """One forward over one row or a batch of rows (branches and sessions), every layer
        or only the first (abandoned part way); a committing one is committed or cancelled.
        Staged and unstaged outputs must be bitwise equal."""
        rows = self.twin_rows(data, max_rows=4)
        if rows:
            self.run_twin(data, rows)

    def shared_tails(self, cache, sessions, pending) -> list[list]:
        """Rows ``(session key, branch)`` grouped by the partly filled tail block they share
        (no pending forward on them), each group sorted."""
        b = self.config.block_size
        sharing = defaultdict(list)
        for key, session in sessions:
            for branch, seq in session.sequences.items():
                if seq.committed % b and (key, branch) not in pending:
                    tail = list.copy(seq.block_table)[seq.committed // b]
                    if cache.pool.refcount(tail) > 1:
                        sharing[tail].append((key, branch))
        return sorted(sharing.values())

    def twin_shared_tails(self) -> list[list[tuple[int, str]]]:
        sessions = [(i, pair[0]) for i, pair in enumerate(self.twin.sessions)]
        return self.shared_tails(self.twin.staged, sessions, self.twin_pending)

    @rule(data=st.data())
    def write_into_shared(self, data) -> None:
        """Forwards that continue a tail block forks share (forking a session whose history
        ends mid-block first when none is shared): on the twin, every row sharing one such
        block in one launch (each must copy it before writing its free slots); on the main
        rollouts, one such sequence."""
        b = self.config.block_size
        if not self.twin_shared_tails() and self.capacity > 1:
            # Make one: fork a session whose history ends mid-block (after a committed forward
            # if need be), closing another session first when every slot is taken.
            index = data.draw(st.integers(0, len(self.sessions) - 1))
            if len(self.sessions) == self.capacity:
                self.close_index(len(self.sessions) - 1 - (index == len(self.sessions) - 1))
                index = min(index, len(self.sessions) - 1)
            rows = [(index, branch) for branch in self.branches]
            if not any(row in self.twin_pending for row in rows):
                sequences = self.twin.sessions[index][0].sequences.values()
                if not all(seq.committed % b for seq in sequences):
                    chunks = data.draw(st.integers(1, self.config.max_forward_chunks))
                    with plain_torch_kernels():
                        self.twin.forward(rows, chunks, commit=True)
                self.fork_session(index)
        groups = self.twin_shared_tails()
        if groups:
            rows = data.draw(st.sampled_from(groups))
            event(f"twin launch over {len(rows)} rows sharing a tail block")
            self.run_twin(data, rows)
        sessions = [(pair[0].id, pair[0]) for pair in self.sessions]
        main = self.shared_tails(self.main.cache, sessions, self.pending)
        if main:
            event("main forward into a shared tail block")
            sid, branch = data.draw(st.sampled_from([row for rows in main for row in rows]))
            pair = next(pair for pair in self.sessions if pair[0].id == sid)
            self.forward(data, commit=data.draw(st.booleans()), row=(pair, branch))

    def run_twin(self, data, rows: list[tuple[int, str]]) -> None:
        chunks = data.draw(st.integers(1, self.config.max_forward_chunks))
        actions = data.draw(st.just(0) | st.integers(0, self.config.max_action_tokens))
        commit = data.draw(st.booleans())
        layers = data.draw(st.sampled_from([None, range(1)]))
        plans = self.twin.plans(rows, chunks, commit=commit, actions=actions)
        with plain_torch_kernels():
            self.twin.run(plans, layers=layers, commit=False)
        if commit and layers is None and data.draw(st.booleans()):
            for cache_plans in plans:
                assert all(plan.commit() for plan in cache_plans)
            return
        for cache, cache_plans in zip(self.twin.caches, plans, strict=True):
            if commit:  # the forward failed (or ran part way): cancelled, as a model would
                for plan in cache_plans:
                    plan.cancel()
            else:  # committing a scratch plan changes nothing
                before = snapshot(cache)
                assert not any(plan.commit() for plan in cache_plans)
                assert snapshot(cache) == before

    @rule(data=st.data(), cancel=st.booleans())
    def twin_prepare_and_drop(self, data, cancel: bool) -> None:
        """A plan prepared and dropped (a committing one stays pending), or cancelled after
        prepare: preparing it again, or a call over it, is refused and changes nothing."""
        rows = self.twin_rows(data, max_rows=1)
        if not rows:
            return
        commit = data.draw(st.booleans())
        plans = self.twin.plans(rows, commit=commit)
        for cache_plans in plans:
            cache_plans[0].prepare()
        if not cancel:
            if commit:
                self.twin_pending[rows[0]] = plans
            return
        for cache, (plan,) in zip(self.twin.caches, plans, strict=True):
            plan.cancel()
            before = snapshot(cache)
            with pytest.raises(ValueError, match="cancelled"):
                plan.prepare()
            with pytest.raises(ValueError, match="cancelled"):
                ForwardCall(cache, plan, softmax_scale=0.5)
            assert snapshot(cache) == before

    @rule(data=st.data())
    def twin_overtaken(self, data) -> None:
        """A scratch plan prepared, then a committing forward of its row commits: the plan is
        overtaken (its blocks may be free again), so preparing it, batching it or a call over
        it is refused and changes nothing."""
        rows = self.twin_rows(data, max_rows=1)
        if not rows:
            return
        plans = self.twin.plans(rows, commit=False)
        for (plan,) in plans:
            plan.prepare()
        with plain_torch_kernels():
            self.twin.forward(rows, commit=True)
        for cache, (plan,) in zip(self.twin.caches, plans, strict=True):
            before = snapshot(cache)
            for hand_out in (
                plan.prepare,
                lambda plan=plan: batch_plans([plan]),
                lambda cache=cache, plan=plan: ForwardCall(cache, plan, softmax_scale=0.5),
            ):
                with pytest.raises(ValueError, match="stale: overtaken by 1 commit"):
                    hand_out()
            assert snapshot(cache) == before

    @precondition(lambda self: self.twin_pending)
    @rule(data=st.data())
    def twin_cancel_dropped(self, data) -> None:
        key = data.draw(st.sampled_from(sorted(self.twin_pending)))
        for (plan,) in self.twin_pending.pop(key):
            plan.cancel()

    @invariant()
    def twin_pools_account_for_every_block(self) -> None:
        for cache in self.twin.caches:
            check_pool(cache)

    @invariant()
    def pools_account_for_every_block(self) -> None:
        if self.main.copies:
            event("the main rollout copied a shared tail block")
        self.main.check_pool()
        self.shadow.check_pool()

    @invariant()
    def residency_matches_the_oracle_and_the_shadow(self) -> None:
        self.main.check_residency()
        self.shadow.check_residency()
        for main_session, shadow_session in self.sessions:
            for branch in self.branches:
                seqs = main_session.sequences[branch], shadow_session.sequences[branch]
                assert resident_model_positions(seqs[0], self.config) == resident_model_positions(
                    seqs[1], self.config
                )


PagingMachine.TestCase.settings = settings(
    settings(), max_examples=8 * settings().max_examples, stateful_step_count=20
)
TestPagingMachine = PagingMachine.TestCase
