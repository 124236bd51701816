"""The paged KV cache: per-layer K and V pools, scratch regions, staging buffers, sessions.

Block ids index the pools' first dimension. Block 0 is the null block; blocks
``1 .. pool.num_blocks`` are managed by the block pool; after them each branch has a scratch
region outside the pool, one lane of blocks per session slot, so every sequence (and so every
row of a batch of plans) has scratch blocks of its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as SequenceOf
from typing import NamedTuple

import torch
from torch import Tensor

from paging import window
from paging._validate import require_bool, require_int
from paging.config import PagingConfig
from paging.plan import ForwardPlan
from paging.pool import BlockPool
from paging.session import Sequence, Session
from paging.staging import NOTHING_STAGED, HistoryStaging


def _usable_device(device: object) -> torch.device:
    """``device`` as a ``torch.device`` that can hold tensors here; ``ValueError`` otherwise."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        device = torch.device(device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:  # torch raises either for a missing GPU
        raise ValueError(
            f"device {str(device)!r} is not usable on this machine ({error}); "
            "use 'cpu' or a device that torch can allocate on"
        ) from None
    return device


class LayerCache(NamedTuple):
    """One layer's storage: 4-D pools, their flat ``(num_blocks * B, ...)`` views, staging."""

    k: Tensor
    v: Tensor
    k_flat: Tensor
    v_flat: Tensor
    stage_k: Tensor | None
    stage_v: Tensor | None


class PagedKVCache:
    """Paged K/V storage for ``session_capacity`` sessions on every branch, forever.

    The pool holds ``session_capacity * len(branches)`` sequences at their peak (the sink, the
    window and the largest forward, see ``window.blocks_per_sequence``); opening one session
    more raises. K and V are separate tensors, stacked over layers: ``k_pools`` is
    ``(num_layers, num_blocks, B, num_kv_heads, head_dim)``, and ``layer(i)`` gives one layer's
    4-D pools and flat views (slot = ``block * B + offset``). ``stage_k``/``stage_v`` are the
    stacked staging buffers, ``(num_layers, width * B, ...)``, with zero rows when the config
    does not stage; ``stage_tags`` (int64, CPU, ``(num_layers,)``) records what each layer's
    staging buffers hold (see ``paging.staging``). Pool memory is not initialised: only
    written slots are ever read.
    """

    def __init__(
        self,
        config: PagingConfig,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        session_capacity: int = 1,
        branches: SequenceOf[str] = ("main",),
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> None:
        if not isinstance(config, PagingConfig):
            raise TypeError(f"config must be a PagingConfig, got {type(config).__name__}")
        require_int("num_layers", num_layers, minimum=1)
        require_int("num_kv_heads", num_kv_heads, minimum=1)
        require_int("head_dim", head_dim, minimum=1)
        require_int("session_capacity", session_capacity, minimum=1)
        if isinstance(branches, str):
            raise TypeError(f"branches must be a sequence of names, not one str: {branches!r}")
        branches = tuple(branches)
        if not branches or not all(isinstance(b, str) for b in branches):
            raise ValueError(f"branches must be a non-empty list of names, got {branches!r}")
        if len(set(branches)) != len(branches):
            raise ValueError(f"branches must be distinct, got {branches!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        device = _usable_device(device)
        self.config = config
        self.branches = branches
        self.session_capacity = session_capacity
        self.device = device
        b = config.block_size

        sequences = session_capacity * len(branches)
        self.pool = BlockPool(sequences * window.blocks_per_sequence(config))
        self.scratch_lane_blocks = window.scratch_blocks_per_sequence(config)
        self.first_scratch_block = 1 + self.pool.num_blocks
        self.num_blocks = self.first_scratch_block + sequences * self.scratch_lane_blocks

        shape = (num_layers, self.num_blocks, b, num_kv_heads, head_dim)
        try:
            self.k_pools = torch.empty(shape, dtype=dtype, device=self.device)
            self.v_pools = torch.empty(shape, dtype=dtype, device=self.device)
            self.staging: HistoryStaging | None = None
            if config.reuse_history_staging:
                self.staging = HistoryStaging(
                    num_layers=num_layers,
                    tokens=self.max_seqlen_k,
                    num_kv_heads=num_kv_heads,
                    head_dim=head_dim,
                    dtype=dtype,
                    device=self.device,
                )
                self.stage_k, self.stage_v = self.staging.k, self.staging.v
                self.stage_tags = self.staging.tags
            else:
                unstaged = (num_layers, 0, num_kv_heads, head_dim)
                self.stage_k = torch.empty(unstaged, dtype=dtype, device=self.device)
                self.stage_v = torch.empty(unstaged, dtype=dtype, device=self.device)
                self.stage_tags = torch.full((num_layers,), NOTHING_STAGED, dtype=torch.int64)
        except RuntimeError as error:  # out of memory: torch.OutOfMemoryError is one too
            elements = 2 * math.prod(shape)
            raise ValueError(
                f"cannot allocate the pools on {device}: 2 x {shape} = {elements} elements of "
                f"{dtype} for num_layers={num_layers}, session_capacity={session_capacity}, "
                f"{len(branches)} branches, num_kv_heads={num_kv_heads}, head_dim={head_dim} "
                f"({error})"
            ) from None
        self.sessions: dict[int, Session] = {}
        self._free_lanes = list(range(session_capacity - 1, -1, -1))
        self._next_session_id = 0

    @property
    def num_layers(self) -> int:
        return self.k_pools.shape[0]

    @property
    def table_width(self) -> int:
        """Block-table width of every plan: fixed by the configuration."""
        return window.table_width(self.config)

    @property
    def max_seqlen_k(self) -> int:
        return self.table_width * self.config.block_size

    def layer(self, index: int) -> LayerCache:
        """Pools (4-D and flat) and staging buffers of layer ``index``."""
        require_int("index", index, minimum=0)
        if index >= self.num_layers:
            raise ValueError(f"index must be < num_layers ({self.num_layers}), got {index}")
        k, v = self.k_pools[index], self.v_pools[index]
        staged = self.staging is not None
        return LayerCache(
            k=k,
            v=v,
            k_flat=k.flatten(0, 1),
            v_flat=v.flatten(0, 1),
            stage_k=self.stage_k[index] if staged else None,
            stage_v=self.stage_v[index] if staged else None,
        )

    def scratch_blocks(self, session: Session, branch: str) -> range:
        """The scratch blocks of ``session``'s sequence on ``branch``, outside the pool."""
        lane = session.lane * len(self.branches) + self.branches.index(branch)
        first = self.first_scratch_block + lane * self.scratch_lane_blocks
        return range(first, first + self.scratch_lane_blocks)

    def open_session(self) -> Session:
        """A new session with an empty sequence per branch; raises when all slots are taken."""
        if not self._free_lanes:
            raise ValueError(
                f"session_capacity={self.session_capacity} sessions are open; close one or "
                "build the cache with a larger session_capacity"
            )
        session = Session(
            id=self._next_session_id,
            lane=self._free_lanes.pop(),
            sequences={branch: Sequence(self.config) for branch in self.branches},
        )
        self._next_session_id += 1
        self.sessions[session.id] = session
        return session

    def check_open(self, session: object) -> Session:
        """``session`` if it is open in this cache; ``TypeError``/``ValueError`` otherwise."""
        if not isinstance(session, Session):
            raise TypeError(f"session must be a Session, got {type(session).__name__}")
        if self.sessions.get(session.id) is not session:
            raise ValueError(f"session {session.id} is not open in this cache")
        return session

    def close_session(self, session: Session) -> None:
        """Return every block of every branch of ``session`` and free its slot."""
        self.check_open(session)
        for sequence in session.sequences.values():
            sequence.release(self.pool)
        session.closed = True
        del self.sessions[session.id]
        self._free_lanes.append(session.lane)

    def plan(
        self,
        session: Session,
        branch: str,
        num_tokens: int,
        *,
        commit: bool = False,
        action_tokens: int = 0,
    ) -> ForwardPlan:
        """A forward of ``num_tokens`` video tokens (whole chunks) plus ``action_tokens``.

        ``commit=True`` makes a committing forward (its video joins the history when the plan
        commits); otherwise a scratch forward. Nothing is allocated until ``prepare``.
        """
        config = self.config
        self.check_open(session)
        if not isinstance(branch, str):
            raise TypeError(f"branch must be a str, got {type(branch).__name__}")
        session.sequence(branch)
        require_int("num_tokens", num_tokens, minimum=1)
        if num_tokens % config.chunk_size or num_tokens > config.max_forward_tokens:
            raise ValueError(
                f"num_tokens must be a whole number of chunks (chunk_size={config.chunk_size}) "
                f"and at most max_forward_tokens={config.max_forward_tokens}, got {num_tokens}"
            )
        require_bool("commit", commit)
        require_int("action_tokens", action_tokens, minimum=0)
        if action_tokens > config.max_action_tokens:
            raise ValueError(
                f"action_tokens must be <= max_action_tokens={config.max_action_tokens}, "
                f"got {action_tokens}"
            )
        return ForwardPlan(
            self,
            session,
            branch,
            num_tokens,
            committing=commit,
            action_tokens=action_tokens,
        )
