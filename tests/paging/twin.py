"""Two caches driven by the same forwards: one with history staging, one without.

Every forward runs through ``ForwardCall`` on both with the same queries and K/V, and the two
outputs must be equal bit for bit: the staged path attends over a copy of exactly the keys the
paged path reads, so any stale or unfilled staging row shows up as a difference. Pools and
staging buffers start NaN-poisoned.

Forks: the staged cache forks (``cache.fork``: shared blocks, copy-on-write), the unstaged one
makes a deep copy (``deep_copy``: a new session with its own copy of every block), so a fork's
outputs must equal its deep-copied twin's bit for bit, and no forward of the staged cache may
write into a block another sequence holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from unittest import mock

import torch
from torch import Tensor

from paged_video.kernels import _runtime
from paged_video.paging import NULL_BLOCK, ForwardPlan, PagedKVCache, PagingConfig, Session
from paged_video.paging.forward import ForwardCall
from tests.paging.rollout import check_own_writes


@contextlib.contextmanager
def plain_torch_kernels() -> Iterator[None]:
    """Run the launchers' plain-PyTorch path on CPU tensors, as on a CPU without Triton's
    interpreter: for tests of the paging state (what is staged, which plans run) that launch
    many small forwards. The kernels themselves are checked against the oracle elsewhere."""
    with mock.patch.object(_runtime, "interpreter_active", return_value=False):
        yield


def deep_copy(cache: PagedKVCache, session: Session) -> Session:
    """A new session of ``cache`` with ``session``'s committed history in blocks of its own:
    every layer's K and V (and scales) copied, nothing shared. What a fork must behave like."""
    copy = cache.open_session()
    stored = (cache.k_pools, cache.v_pools, cache.k_scales, cache.v_scales)
    for branch, source in session.sequences.items():
        table = list.copy(source.block_table)
        blocks = [block for block in table if block != NULL_BLOCK]
        fresh = dict(zip(blocks, cache.pool.allocate(len(blocks)), strict=True))
        for tensor in (t for t in stored if t.numel()):  # a float cache's scales are empty
            for old, new in fresh.items():
                tensor[:, new].copy_(tensor[:, old])
        target = copy.sequences[branch]
        target.block_table = [fresh.get(block, NULL_BLOCK) for block in table]
        target.committed, target.compacted = source.committed, source.compacted
        target.evicted = source.evicted
    return copy


def poison(cache: PagedKVCache) -> None:
    """NaN in the pools and staging buffers; quantized ones: NaN scales and NaN codes (e4m3)
    or int8's never-written -128 (k8v8: int8 K, e4m3 V; k8v16: int8 K, float V)."""
    codes = (cache.k_pools, cache.v_pools, cache.stage_k, cache.stage_v)
    for buffer in codes:
        if buffer.dtype.is_floating_point and buffer.dtype != torch.float8_e4m3fn:
            buffer.fill_(float("nan"))
        else:
            nan_code = 0x7F if buffer.dtype == torch.float8_e4m3fn else -128
            buffer.view(torch.int8).fill_(nan_code)
    if not cache.quantized:
        return
    for buffer in (cache.k_scales, cache.v_scales, cache.stage_k_scales, cache.stage_v_scales):
        buffer.fill_(float("nan"))


class Twin:
    """A staged and an unstaged ``PagedKVCache`` of one geometry, stepped together."""

    def __init__(
        self,
        config: PagingConfig,
        *,
        branches: tuple[str, ...] = ("main",),
        session_capacity: int = 1,
        num_layers: int = 2,
        num_heads: int = 2,
        num_kv_heads: int = 1,
        head_dim: int = 4,
        seed: int = 0,
    ) -> None:
        self.config = config
        self.caches = tuple(
            PagedKVCache(
                dataclasses.replace(config, reuse_history_staging=staged),
                num_layers=num_layers,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                session_capacity=session_capacity,
                branches=branches,
                dtype=torch.float32,
            )
            for staged in (True, False)
        )
        for cache in self.caches:
            poison(cache)
        self.shape = (num_heads, num_kv_heads, head_dim)
        self.scale = head_dim**-0.5
        self.generator = torch.Generator().manual_seed(seed)
        self.sessions: list[tuple[Session, Session]] = []
        # Multiply the video keys' channels ``(num_kv_heads, head_dim)`` (rows that grow) and
        # the queries' ``(head_dim,)``.
        self.key_gain: Tensor | None = None
        self.query_gain: Tensor | None = None

    @property
    def staged(self) -> PagedKVCache:
        return self.caches[0]

    def open(self) -> int:
        """Open a session on both caches; returns its index in ``sessions``."""
        self.sessions.append(tuple(cache.open_session() for cache in self.caches))
        return len(self.sessions) - 1

    def fork(self, index: int) -> int:
        """Fork session ``index`` on the staged cache, deep-copy it on the unstaged one."""
        staged, unstaged = self.sessions[index]
        self.sessions.append((self.caches[0].fork(staged), deep_copy(self.caches[1], unstaged)))
        return len(self.sessions) - 1

    def close(self, index: int) -> None:
        for cache, session in zip(self.caches, self.sessions.pop(index), strict=True):
            cache.close_session(session)

    def plans(
        self, rows: list[tuple[int, str]], chunks: int = 1, *, commit: bool, actions: int = 0
    ) -> tuple[list[ForwardPlan], list[ForwardPlan]]:
        """Unprepared plans of ``rows`` (session index, branch) on each cache."""
        n = chunks * self.config.chunk_size
        return tuple(
            [
                cache.plan(self.sessions[s][c], branch, n, commit=commit, action_tokens=actions)
                for s, branch in rows
            ]
            for c, cache in enumerate(self.caches)
        )

    def _random(self, tokens: int, heads: int) -> Tensor:
        return torch.randn(tokens, heads, self.shape[2], generator=self.generator)

    def run(
        self,
        plans: tuple[list[ForwardPlan], list[ForwardPlan]],
        *,
        layers: range | None = None,
        commit: bool = True,
    ) -> list[tuple[Tensor, Tensor]]:
        """One ``ForwardCall`` per cache over ``plans``; every layer (or ``layers``) attends.

        Returns each layer's (staged, unstaged) outputs after checking they are bitwise equal.
        ``commit`` commits the committing plans afterwards.
        """
        calls = [
            ForwardCall(cache, p, softmax_scale=self.scale)
            for cache, p in zip(self.caches, plans, strict=True)
        ]
        for plan in plans[0]:
            check_own_writes(self.staged, plan)
        heads, kv_heads, _ = self.shape
        video = sum(plan.num_tokens for plan in plans[0])
        actions = sum(plan.action_tokens for plan in plans[0])
        outputs = []
        for layer in layers if layers is not None else range(self.staged.num_layers):
            q = self._random(video, heads)
            k, v = self._random(video, kv_heads), self._random(video, kv_heads)
            if self.key_gain is not None:
                k = k * self.key_gain
            if self.query_gain is not None:
                q = q * self.query_gain
            ak, av = self._random(actions, kv_heads), self._random(actions, kv_heads)
            pair = tuple(call.attend(layer, q, k, v, ak, av) for call in calls)
            assert not torch.isnan(pair[1]).any(), "the unstaged path read an unwritten slot"
            assert torch.equal(pair[0], pair[1]), (
                f"layer {layer}: staged (forked) output differs from unstaged (deep-copied) by "
                f"{(pair[0] - pair[1]).abs().max().item():.3g} (stage_from={calls[0].stage_from})"
            )
            outputs.append(pair)
        if commit:
            for call in calls:
                call.commit()
        return outputs

    def forward(
        self, rows: list[tuple[int, str]], chunks: int = 1, *, commit: bool, actions: int = 0
    ) -> list[tuple[Tensor, Tensor]]:
        """Plan, run every layer and commit ``rows`` as one call on each cache."""
        return self.run(self.plans(rows, chunks, commit=commit, actions=actions))
