"""A stateful hypothesis machine over random geometries, checked after every step.

Every forward is checked slot by slot against the window oracle and the slot ledger (see
``rollout.py``); a shadow cache without compaction runs the same steps and must keep the same
model positions resident. Runs ``9 x`` the loaded profile's ``max_examples`` (>= 500 under
``--hypothesis-profile=ci``).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from paging import PagingConfig
from tests.paging.rollout import Rollout, resident_model_positions, snapshot


@st.composite
def setups(draw) -> tuple[PagingConfig, tuple[str, ...], int]:
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
    return config, branches, draw(st.integers(1, 2))


class PagingMachine(RuleBasedStateMachine):
    @initialize(setup=setups())
    def build(self, setup) -> None:
        config, branches, capacity = setup
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
        self.sessions: list[tuple] = []
        self.pending: dict[tuple[int, str], tuple] = {}
        self.open_session()

    def pick(self, data):
        pair = data.draw(st.sampled_from(self.sessions))
        branch = data.draw(st.sampled_from(self.branches))
        chunks = data.draw(st.integers(1, self.config.max_forward_chunks))
        actions = data.draw(st.just(0) | st.integers(0, self.config.max_action_tokens))
        return pair, branch, chunks, actions

    @rule()
    def open_session(self) -> None:
        if len(self.sessions) < self.capacity:
            self.sessions.append((self.main.open(), self.shadow.open()))
            return
        for rollout in (self.main, self.shadow):
            before = snapshot(rollout.cache)
            with pytest.raises(ValueError, match="session_capacity"):
                rollout.cache.open_session()
            assert snapshot(rollout.cache) == before

    @rule(data=st.data())
    def close_session(self, data) -> None:
        """Close a session; when none is left, every block is free again: open a new one."""
        pair = data.draw(st.sampled_from(self.sessions))
        self.sessions.remove(pair)
        self.pending = {key: v for key, v in self.pending.items() if key[0] != pair[0].id}
        for rollout, session in zip((self.main, self.shadow), pair, strict=True):
            rollout.cache.close_session(session)
        if not self.sessions:
            for rollout in (self.main, self.shadow):
                assert rollout.cache.pool.num_free == rollout.cache.pool.num_blocks
            self.open_session()

    def forward(self, data, *, commit: bool) -> None:
        pair, branch, chunks, actions = self.pick(data)
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
        key = data.draw(st.sampled_from(sorted(self.pending)))
        for record in self.pending.pop(key):
            record.plan.cancel()

    @invariant()
    def pools_account_for_every_block(self) -> None:
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
    settings(), max_examples=9 * settings().max_examples, stateful_step_count=20
)
TestPagingMachine = PagingMachine.TestCase
