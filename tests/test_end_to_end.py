"""End to end: paging plans -> the fused write+attend op -> the real kernels, over many ticks.

Each forward's attention output is compared with float64 dense attention over exactly the
model positions the window oracle says (whole-block reads, or the exact window), plus the
forward's action tokens. The pools start NaN-poisoned, so any read of an unwritten slot fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from paged_video import kernels, reference
from paged_video.paging import ForwardPlan, PagedKVCache, PagingConfig, Session
from paged_video.paging.forward import ForwardCall
from paged_video.reference import WindowGeometry
from tests.helpers import DEVICE

ATOL = 3e-5
ORACLE_QUERY_CHUNK = 1024  # bounds the oracle's float64 score matrix at the shipped geometry


@dataclass
class History:
    """What the model committed on one sequence, per layer: model position -> K and V."""

    keys: list[dict[int, torch.Tensor]] = field(default_factory=list)
    values: list[dict[int, torch.Tensor]] = field(default_factory=list)


class ModelRollout:
    """Drives a cache like a model would, checking every attention output against the oracle."""

    def __init__(
        self,
        config: PagingConfig,
        *,
        layers: int = 2,
        heads: int = 4,
        kv_heads: int = 2,
        head_dim: int = 16,
        branches: tuple[str, ...] = ("main",),
        sessions: int = 1,
        seed: int = 0,
    ) -> None:
        self.config = config
        self.cache = PagedKVCache(
            config,
            num_layers=layers,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            session_capacity=sessions,
            branches=branches,
            dtype=torch.float32,
            device=DEVICE,
        )
        for buffer in (
            self.cache.k_pools,
            self.cache.v_pools,
            self.cache.stage_k,
            self.cache.stage_v,
        ):
            buffer.fill_(float("nan"))
        self.geometry = WindowGeometry(
            chunk_size=config.chunk_size,
            block_size=config.block_size,
            sink_chunks=config.sink_chunks,
            window_chunks=config.window_chunks,
            reset_at_boundary=config.reset_at_boundary,
        )
        self.shape = (layers, heads, kv_heads, head_dim)
        self.scale = head_dim**-0.5
        self.gen = torch.Generator().manual_seed(seed)
        self.history: dict[tuple[int, str], History] = {}
        self.outputs: list[torch.Tensor] = []

    def open(self) -> Session:
        session = self.cache.open_session()
        for branch in self.cache.branches:
            self.history[session.id, branch] = History(
                keys=[{} for _ in range(self.shape[0])], values=[{} for _ in range(self.shape[0])]
            )
        return session

    def _random(self, tokens: int, heads: int) -> torch.Tensor:
        return torch.randn(tokens, heads, self.shape[3], generator=self.gen).to(DEVICE)

    def forward(
        self,
        rows: list[tuple[Session, str]],
        chunks: int,
        *,
        commit: bool,
        actions: int = 0,
        call_rows_together: bool = True,
        attend: bool = True,
    ) -> list[ForwardPlan]:
        """One forward of every row (batched into one call, or one call per row); checked.

        ``attend=False`` only writes the K/V where the plans say (to build history cheaply).
        """
        n = chunks * self.config.chunk_size
        plans = [
            self.cache.plan(session, branch, n, commit=commit, action_tokens=actions)
            for session, branch in rows
        ]
        calls = (
            [ForwardCall(self.cache, plans, softmax_scale=self.scale)]
            if call_rows_together
            else [ForwardCall(self.cache, plan, softmax_scale=self.scale) for plan in plans]
        )
        layers, heads, kv_heads, _ = self.shape
        if not attend:
            self._write_only(plans, commit)
            return plans
        for layer in range(layers):
            q = self._random(n * len(plans), heads)
            k, v = self._random(n * len(plans), kv_heads), self._random(n * len(plans), kv_heads)
            ak, av = (
                self._random(actions * len(plans), kv_heads),
                self._random(actions * len(plans), kv_heads),
            )
            per_call = len(plans) // len(calls)
            outs = []
            for c, call in enumerate(calls):
                rows_q = slice(c * per_call * n, (c + 1) * per_call * n)
                rows_a = slice(c * per_call * actions, (c + 1) * per_call * actions)
                outs.append(
                    call.attend(layer, q[rows_q], k[rows_q], v[rows_q], ak[rows_a], av[rows_a])
                )
            out = torch.cat(outs)
            self.outputs.append(out)
            for r, plan in enumerate(plans):
                rq, ra = slice(r * n, (r + 1) * n), slice(r * actions, (r + 1) * actions)
                self._check_row(plan, layer, q[rq], k[rq], v[rq], ak[ra], av[ra], out[rq])
                if commit:
                    self._remember(plan, layer, k[rq], v[rq])
        for call in calls:
            call.commit()
        return plans

    def _write_only(self, plans: list[ForwardPlan], commit: bool) -> None:
        kv_heads = self.shape[2]
        for layer in range(self.shape[0]):
            storage = self.cache.layer(layer)
            for plan in plans:
                k = self._random(plan.num_tokens, kv_heads)
                v = self._random(plan.num_tokens, kv_heads)
                kernels.write_slots(k, v, storage.k_flat, storage.v_flat, plan.inputs.video_slots)
                if commit:
                    self._remember(plan, layer, k, v)
        for plan in plans:
            plan.commit()

    def _remember(self, plan: ForwardPlan, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        history = self.history[plan.session.id, plan.branch]
        for t in range(plan.num_tokens):
            history.keys[layer][plan.history + t] = k[t]
            history.values[layer][plan.history + t] = v[t]

    def _check_row(self, plan, layer, q, k, v, ak, av, out) -> None:
        history = self.history[plan.session.id, plan.branch]
        reads = (
            reference.kept_positions if self.config.exact_window else reference.block_read_positions
        )
        positions = reads(self.geometry, plan.history, plan.num_tokens)
        past = [p for p in positions if p < plan.history]
        keys = torch.stack([history.keys[layer][p] for p in past] + list(k) + list(ak))
        values = torch.stack([history.values[layer][p] for p in past] + list(v) + list(av))
        assert len(positions) - len(past) == plan.num_tokens
        assert not torch.isnan(out).any(), "attention read an unwritten (NaN) slot"
        for lo in range(0, q.shape[0], ORACLE_QUERY_CHUNK):
            want = reference.dense_attention(
                q[lo : lo + ORACLE_QUERY_CHUNK], keys, values, softmax_scale=self.scale
            )
            got = out[lo : lo + ORACLE_QUERY_CHUNK].double()
            error = (got - want).abs().max().item()
            assert error <= ATOL, f"layer {layer}, history {plan.history}: max error {error:.2e}"


def run_ticks(rollout: ModelRollout, rows, ticks: int, *, chunks: int, scratch: int, actions: int):
    """Per tick: ``scratch`` non-committing forwards, then the committing one (shipped: 4+1)."""
    for _ in range(ticks):
        for _ in range(scratch):
            rollout.forward(rows, chunks, commit=False, actions=actions)
        rollout.forward(rows, chunks, commit=True, actions=actions)


RAGGED = dict(chunk_size=24, block_size=16)


@pytest.mark.parametrize(
    "reset, staged, exact",
    [
        pytest.param(False, False, False, id="sliding"),
        pytest.param(False, True, False, id="sliding-staged"),
        pytest.param(False, False, True, id="sliding-exact"),
        pytest.param(True, False, False, id="reset"),
        pytest.param(True, True, True, id="reset-staged-exact"),
    ],
)
def test_ragged_chunks_over_many_ticks(reset: bool, staged: bool, exact: bool) -> None:
    # C = 24, B = 16: chunks begin and end mid-block; actions follow a mid-block video end.
    config = PagingConfig(
        **RAGGED,
        sink_chunks=1,
        window_chunks=3,
        max_forward_chunks=2,
        max_action_tokens=5,
        reset_at_boundary=reset,
        reuse_history_staging=staged,
        exact_window=exact,
    )
    rollout = ModelRollout(config)
    session = rollout.open()
    run_ticks(rollout, [(session, "main")], 6, chunks=2, scratch=2, actions=5)
    assert session.sequences["main"].evicted > 0


def test_block_aligned_chunks_reuse_staging() -> None:
    # C = B = 16: repeated scratch forwards over the same history restage only their chunk.
    config = PagingConfig(
        chunk_size=16,
        block_size=16,
        sink_chunks=1,
        window_chunks=3,
        max_forward_chunks=1,
        reuse_history_staging=True,
    )
    rollout = ModelRollout(config)
    session = rollout.open()
    run_ticks(rollout, [(session, "main")], 3, chunks=1, scratch=0, actions=0)
    (first,) = rollout.forward([(session, "main")], 1, commit=False)
    (second,) = rollout.forward([(session, "main")], 1, commit=False)
    assert first.stage_from == 0
    # The visible history blocks: the sink's one block and the recent range's before the chunk.
    assert second.stage_from == len(first.inputs.block_table[0].nonzero()) - 1


def test_action_tokens_after_mid_block_video() -> None:
    # The FlashAttention-based design refused this: a video run ending part way into a block,
    # followed by action tokens. Both committing and scratch forwards.
    config = PagingConfig(
        chunk_size=10,
        block_size=16,
        sink_chunks=0,
        window_chunks=2,
        max_forward_chunks=1,
        max_action_tokens=19,
    )
    rollout = ModelRollout(config)
    session = rollout.open()
    for tick in range(4):
        (plan,) = rollout.forward([(session, "main")], 1, commit=tick % 2 == 0, actions=19)
        assert (plan.history + plan.num_tokens) % 16 != 0


def test_batched_rows_equal_separate_calls() -> None:
    # Both CFG branches of two sessions in one paged_attention launch, one block-table row each.
    config = PagingConfig(
        **RAGGED,
        sink_chunks=1,
        window_chunks=3,
        max_forward_chunks=1,
        max_action_tokens=3,
    )
    together = ModelRollout(config, branches=("positive", "negative"), sessions=2, seed=5)
    apart = ModelRollout(config, branches=("positive", "negative"), sessions=2, seed=5)
    rows_t = [(s, b) for s in (together.open(), together.open()) for b in ("positive", "negative")]
    rows_a = [(s, b) for s in (apart.open(), apart.open()) for b in ("positive", "negative")]
    for tick in range(4):
        together.forward(rows_t, 1, commit=tick % 2 == 1, actions=3)
        apart.forward(rows_a, 1, commit=tick % 2 == 1, actions=3, call_rows_together=False)
    for a, b in zip(together.outputs, apart.outputs, strict=True):
        assert torch.equal(a, b)


def test_staged_and_unstaged_agree() -> None:
    base = dict(**RAGGED, sink_chunks=1, window_chunks=2, max_forward_chunks=1, max_action_tokens=2)
    runs = []
    for staged in (False, True):
        rollout = ModelRollout(PagingConfig(**base, reuse_history_staging=staged), seed=9)
        session = rollout.open()
        run_ticks(rollout, [(session, "main")], 4, chunks=1, scratch=1, actions=2)
        runs.append(rollout.outputs)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)  # one launch, one order of sums (docs/paging.md)


def test_shipped_geometry_reduced_heads() -> None:
    # C = 1560, B = 16, sink 9, window 9, 3 frames per forward, at 1 layer and one head of 16
    # so the interpreter can run it. Six committing forwards fill the sink and the window
    # (written through the plans, without attention, to save time); then a scratch and a
    # committing forward attend through the fused op while the window slides.
    config = PagingConfig(
        chunk_size=1560,
        block_size=16,
        sink_chunks=9,
        window_chunks=9,
        max_forward_chunks=3,
    )
    rollout = ModelRollout(config, layers=1, heads=1, kv_heads=1, head_dim=16)
    session = rollout.open()
    width = rollout.cache.table_width
    for _ in range(6):
        rollout.forward([(session, "main")], 3, commit=True, attend=False)
    for commit in (False, True):
        (plan,) = rollout.forward([(session, "main")], 3, commit=commit)
        assert plan.inputs.block_table.shape[1] == width
    sequence = session.sequences["main"]
    # 21 chunks committed, 9 in the sink and 9 in the window: 3 skipped (docs/paging.md's formula).
    assert sequence.evicted + sequence.compacted == 3 * 1560


@pytest.mark.parametrize("staged", [False, True], ids=["paged", "staged"])
def test_real_plans_compile_once(staged: bool) -> None:
    # Forwards from real plans: new block ids, new slots, longer history, another layer each
    # time; the compiled block must not recompile.
    from torch._dynamo.testing import CompileCounter

    from paged_video.kernels.fused import write_attend

    config = PagingConfig(
        **RAGGED,
        sink_chunks=1,
        window_chunks=3,
        max_forward_chunks=1,
        max_action_tokens=4,
        reuse_history_staging=staged,
    )
    rollout = ModelRollout(config, layers=3)
    cache = rollout.cache
    session = rollout.open()

    def block(q, k, v, ak, av, inputs):
        out = write_attend(q, k, v, ak, av, cache.pool_tensors, inputs)
        return out * 2.0

    counter = CompileCounter()
    compiled = torch.compile(block, fullgraph=True, backend=counter)
    for step in range(3):
        plan = cache.plan(session, "main", 24, commit=True, action_tokens=4)
        call = ForwardCall(cache, plan, softmax_scale=rollout.scale)
        layer = step % 3
        q, k, v = rollout._random(24, 4), rollout._random(24, 2), rollout._random(24, 2)
        ak, av = rollout._random(4, 2), rollout._random(4, 2)
        got = compiled(q, k, v, ak, av, call.layer(layer))
        rollout._check_row(plan, layer, q, k, v, ak, av, got / 2.0)
        for other in range(3):  # every layer gets this forward's history
            if other != layer:
                call.attend(other, q, k, v, ak, av)
            rollout._remember(plan, other, k, v)
        call.commit()
    assert counter.frame_count == 1
