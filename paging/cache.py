"""The paged KV cache: per-layer K and V pools, scratch regions, staging buffers, sessions.

Block ids index the pools' first dimension. Block 0 is the null block; blocks
``1 .. pool.num_blocks`` are managed by the block pool; after them each branch has a scratch
region outside the pool, one lane of blocks per session slot, so every sequence (and so every
row of a batch of plans) has scratch blocks of its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as SequenceOf
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from paged_video._removed import refuse_e4m3_pool
from paged_video.paging import window
from paged_video.paging._validate import require_bool, require_int
from paged_video.paging.config import KV_DTYPES, PagingConfig
from paged_video.paging.plan import ForwardPlan
from paged_video.paging.pool import NULL_BLOCK, BlockPool, PoolStats
from paged_video.paging.session import Sequence, Session
from paged_video.paging.staging import NOTHING_STAGED, HistoryStaging

if TYPE_CHECKING:
    from paged_video.kernels.fused import PoolTensors


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
    """One layer's storage: 4-D pools, their flat ``(num_blocks * B, ...)`` views (None for
    keys-major pools, which have none), staging.

    Quantized caches also give the scales ``(num_blocks, B, num_kv_heads)`` and, with
    smoothing, the layer's K mean ``(num_kv_heads, head_dim)`` and its 0-dim CPU flag
    ``k_mean_chosen``; with channel equalization, the layer's factors ``k_equalizer``/
    ``v_equalizer`` ``(num_kv_heads, head_dim)`` and their 0-dim CPU flag ``equalizers_chosen``;
    else None. A driver of its own passes ``write_kwargs()`` to ``write_slots`` and
    ``attention_kwargs()`` to ``paged_attention``: the scales, the mean and the factors with
    their flags, so the first write chooses the layer's mean and factors and records them for
    every later write (the fused op's included), and attention folds the factors back in.
    """

    k: Tensor
    v: Tensor
    k_flat: Tensor | None
    v_flat: Tensor | None
    stage_k: Tensor | None
    stage_v: Tensor | None
    k_scale: Tensor | None = None
    v_scale: Tensor | None = None
    k_mean: Tensor | None = None
    k_mean_chosen: Tensor | None = None
    k_equalizer: Tensor | None = None
    v_equalizer: Tensor | None = None
    equalizers_chosen: Tensor | None = None
    v_channel_scale: Tensor | None = None
    v_scale_chosen: Tensor | None = None
    v_saturated: Tensor | None = None

    @property
    def write_pools(self) -> tuple[Tensor, Tensor]:
        """The K and V pools ``write_slots`` takes with ``write_kwargs()``: the flat views, or
        the 4-D pools of a keys-major cache (which have none)."""
        if self.k_flat is None:
            return self.k, self.v
        return self.k_flat, self.v_flat

    def write_kwargs(self) -> dict[str, Tensor]:
        """Keyword arguments for ``write_slots`` after ``key, value, *write_pools, slots``: the
        scales (shaped like ``write_pools`` without head_dim), the K mean, the equalization
        factors and their flags (none for a float cache)."""
        if self.k_scale is None:
            return {}
        if self.v_channel_scale is not None:
            return self._k8v8_kwargs() | {
                "v_scale_chosen": self.v_scale_chosen,
                "v_saturated": self.v_saturated,
            }
        if self.v_scale is None:  # k8v16: V stored as it is
            kwargs = self._k8v8_kwargs()
            kwargs.pop("v_channel_scale")
            return kwargs
        k_scale, v_scale = self.k_scale, self.v_scale
        if self.k_flat is not None:
            k_scale, v_scale = k_scale.flatten(0, 1), v_scale.flatten(0, 1)
        kwargs = {"k_scale": k_scale, "v_scale": v_scale}
        if self.k_mean is not None:
            kwargs |= {"k_smooth": self.k_mean, "k_smooth_chosen": self.k_mean_chosen}
        if self.k_equalizer is not None:
            kwargs |= {
                "k_equalizer": self.k_equalizer,
                "v_equalizer": self.v_equalizer,
                "equalizers_chosen": self.equalizers_chosen,
            }
        return kwargs

    def attention_kwargs(self) -> dict[str, Tensor]:
        """Keyword arguments for ``paged_attention`` over ``k, v``: the scales and the
        equalization factors (float: none)."""
        if self.k_scale is None:
            return {}
        if self.v_channel_scale is not None or self.v_scale is None:  # k8v8, k8v16
            kwargs = {"k_scale": self.k_scale}
            if self.v_channel_scale is not None:
                kwargs["v_channel_scale"] = self.v_channel_scale
            if self.k_equalizer is not None:
                kwargs["k_equalizer"] = self.k_equalizer
            return kwargs
        kwargs = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        if self.k_equalizer is not None:
            kwargs |= {"k_equalizer": self.k_equalizer, "v_equalizer": self.v_equalizer}
        return kwargs

    def _k8v8_kwargs(self) -> dict[str, Tensor]:
        """A k8v8 layer's ``write_slots`` keywords but the V flag and counter: K's scales,
        mean and factors, V's channel scales (no V factors: the channel scales take theirs)."""
        kwargs = {"k_scale": self.k_scale, "v_channel_scale": self.v_channel_scale}
        if self.k_mean is not None:
            kwargs |= {"k_smooth": self.k_mean, "k_smooth_chosen": self.k_mean_chosen}
        if self.k_equalizer is not None:
            kwargs |= {"k_equalizer": self.k_equalizer, "equalizers_chosen": self.equalizers_chosen}
        return kwargs


class BlockCounts(NamedTuple):
    """A session's pool blocks: those only its tables hold, and those other sessions' hold too."""

    exclusive: int
    shared: int


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

    Forks: ``fork(session)`` makes a session that continues another's committed history on
    every branch, its tables listing the same blocks (reference-counted in the pool, nothing
    copied). A fork is a session: it takes a session slot and counts against
    ``session_capacity``, and the pool needs no more blocks, since a fork's tables never hold
    more than a session's, shared blocks are held once, and copy-on-write (a forward continuing
    a shared tail block copies it first) replaces a table entry, never adds one. A refused fork
    changes nothing. Forks hold fewer blocks than separate sessions only while they share
    history (a fork that slides a whole window on shares only the sink), so the pool stays sized
    for ``session_capacity`` sessions; ``pool_blocks`` (at least one session's,
    ``len(branches) * window.blocks_per_sequence(config)``) sizes it by blocks instead, for
    forks that stay near their fork point: a forward the pool cannot hold then raises
    ``PoolExhaustedError`` and changes nothing (``pool_stats`` shows what is held).

    Quantized caches (``config.kv_dtype``, or a ``dtype`` of ``int8``) hold
    codes in the pools and staging buffers, with float32 scales beside them: ``k_scales``/
    ``v_scales`` ``(num_layers, num_blocks, B, num_kv_heads)`` and ``stage_k_scales``/
    ``stage_v_scales`` ``(num_layers, width * B, num_kv_heads)``; with ``smooth_keys``,
    ``k_means`` ``(num_layers, num_kv_heads, head_dim)`` float32 and ``k_means_chosen``
    ``(num_layers,)`` bool (on the CPU) are each layer's frozen K mean and whether it has
    been chosen; with channel equalization (``config.channel_equalization``), ``k_equalizers``/
    ``v_equalizers`` ``(num_layers, num_kv_heads, head_dim)`` float32 and ``equalizers_chosen``
    ``(num_layers,)`` bool (on the CPU) likewise. A float cache has zero-size tensors in their
    place. ``pool_tensors`` hands them all to the fused op.
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
        pool_blocks: int | None = None,
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
        refuse_e4m3_pool("dtype", dtype)
        if not isinstance(dtype, torch.dtype) or not (
            dtype.is_floating_point or dtype in KV_DTYPES
        ):
            raise TypeError(
                f"dtype must be a floating-point torch.dtype (or a quantized one: "
                f"int8), got {dtype!r}"
            )
        if config.keys_major and (config.kv_dtype or dtype) not in KV_DTYPES:
            raise ValueError(
                f"config.keys_major needs quantized pools (kv_dtype int8), got "
                f"{dtype} pools: the 16-bit kernels' TMA loops read slot-major pools"
            )
        sequences = session_capacity * len(branches)
        per_sequence = window.blocks_per_sequence(config)
        if pool_blocks is None:
            pool_blocks = sequences * per_sequence
        require_int("pool_blocks", pool_blocks, minimum=len(branches) * per_sequence)
        device = _usable_device(device)
        self.config = config
        self.branches = branches
        self.session_capacity = session_capacity
        self.device = device
        self._dtype = dtype  # (k8v16 stores V in it)
        b = config.block_size

        self.pool = BlockPool(pool_blocks, copy_contents=self._copy_block)
        self.scratch_lane_blocks = window.scratch_blocks_per_sequence(config)
        self.first_scratch_block = 1 + self.pool.num_blocks
        self.num_blocks = self.first_scratch_block + sequences * self.scratch_lane_blocks

        shape = (num_layers, self.num_blocks, b, num_kv_heads, head_dim)
        kv_dtype = config.kv_dtype if config.kv_dtype is not None else dtype
        if config.k8v8 or config.k8v16:
            kv_dtype = torch.int8  # K's codes; V's are e4m3 or the cache's dtype (_allocate)
        self.quantized = kv_dtype in KV_DTYPES
        try:
            self._allocate(shape, kv_dtype)
        except RuntimeError as error:  # out of memory: torch.OutOfMemoryError is one too
            scales = f" and 2 x {shape[:-1]} float32 scales" if self.quantized else ""
            raise ValueError(
                f"cannot allocate the pools on {device}: 2 x {shape} = {2 * math.prod(shape)} "
                f"elements of {kv_dtype}{scales} for num_layers={num_layers}, "
                f"session_capacity={session_capacity}, {len(branches)} branches, "
                f"num_kv_heads={num_kv_heads}, head_dim={head_dim} ({error})"
            ) from None
        self.sessions: dict[int, Session] = {}
        self._free_lanes = list(range(session_capacity - 1, -1, -1))
        self._next_session_id = 0

    def _allocate(self, shape: tuple[int, ...], kv_dtype: torch.dtype) -> None:
        """The pools, their scales and K means, and the staging buffers (see the class doc)."""
        num_layers, _, _, num_kv_heads, head_dim = shape
        device, quantized = self.device, self.quantized

        def empty(*size: int, dtype: torch.dtype = torch.float32) -> Tensor:
            return torch.empty(size, dtype=dtype, device=device)

        def empty_pool(*size: int, dtype: torch.dtype = torch.float32, keys_major: bool) -> Tensor:
            if not keys_major:
                return empty(*size, dtype=dtype)
            # Here, not at the top: a float cache's bookkeeping never loads Triton.
            from paged_video.kernels.pool_layout import empty_keys_major

            pools = empty_keys_major(size[0] * size[1], *size[2:], dtype=dtype, device=device)
            return pools.unflatten(0, size[:2])

        # Keys-major: the scales, and k8v8's V codes (its P V MMA reduces over keys). K's codes
        # stay slot-major: Q K^T reduces over channels, and the TMA loop reads K so.
        keys_major = self.config.keys_major
        k8v8, k8v16 = self.config.k8v8, self.config.k8v16
        self.k_pools = empty_pool(*shape, dtype=kv_dtype, keys_major=False)
        v_dtype = torch.float8_e4m3fn if k8v8 else self._dtype if k8v16 else kv_dtype
        self.v_pools = empty_pool(*shape, dtype=v_dtype, keys_major=k8v8)
        if quantized:
            self.k_scales = empty_pool(*shape[:-1], keys_major=keys_major or k8v8 or k8v16)
            self.v_scales = (
                empty(0) if k8v8 or k8v16 else empty_pool(*shape[:-1], keys_major=keys_major)
            )
        else:
            self.k_scales, self.v_scales = empty(0), empty(0)
        # k8v8: V's scales per (layer, KV head, channel), frozen at the layer's first write
        # (block stride 0: kernels.value_channels), their CPU flags, and a device count per
        # layer of V elements written saturated.
        num_blocks = shape[1]
        if k8v8:
            channels = torch.zeros(num_layers, 1, num_kv_heads, head_dim, device=device)
            self.v_channel_scales = channels.expand(-1, num_blocks, -1, -1)
        else:
            self.v_channel_scales = empty(0)
        self.v_scales_chosen = torch.zeros(num_layers if k8v8 else 0, dtype=torch.bool)
        self.v_saturated = torch.zeros(num_layers if k8v8 else 0, dtype=torch.int32, device=device)
        smoothed = quantized and self.config.smooth_keys
        self.k_means = empty(*((num_layers, num_kv_heads, head_dim) if smoothed else (0,)))
        self.k_means.zero_()
        # On the CPU, as stage_tags: the fused op reads it without a device sync.
        self.k_means_chosen = torch.zeros(num_layers if smoothed else 0, dtype=torch.bool)
        # Factors of 1 until a layer's first write chooses them (then frozen, as the mean).
        equalized = quantized and self.config.channel_equalization(kv_dtype)
        factor_shape = (num_layers, num_kv_heads, head_dim) if equalized else (0,)
        self.k_equalizers = torch.ones(factor_shape, device=device)
        self.v_equalizers = torch.ones(factor_shape, device=device)
        self.equalizers_chosen = torch.zeros(num_layers if equalized else 0, dtype=torch.bool)
        self.staging: HistoryStaging | None = None
        if self.config.reuse_history_staging:
            self.staging = HistoryStaging(
                num_layers=num_layers,
                tokens=self.max_seqlen_k,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                dtype=kv_dtype,
                device=device,
                scales=quantized,
                v_dtype=v_dtype,
                v_scales=not (k8v8 or k8v16),
            )
            self.stage_k, self.stage_v = self.staging.k, self.staging.v
            self.stage_k_scales, self.stage_v_scales = self.staging.k_scales, self.staging.v_scales
            self.stage_tags = self.staging.tags
        else:
            unstaged = (num_layers, 0, num_kv_heads, head_dim)
            self.stage_k = empty(*unstaged, dtype=kv_dtype)
            self.stage_v = empty(*unstaged, dtype=v_dtype)
            stage_scales = unstaged[:-1] if quantized else (0,)
            self.stage_k_scales = empty(*stage_scales)
            self.stage_v_scales = empty(*((0,) if k8v8 or k8v16 else stage_scales))
            self.stage_tags = torch.full((num_layers,), NOTHING_STAGED, dtype=torch.int64)

    @property
    def pool_tensors(self) -> PoolTensors:
        """Every cache tensor the fused op reads or writes (``kernels.fused.PoolTensors``)."""
        from paged_video.kernels.fused import (
            PoolTensors,  # here: bookkeeping alone never loads Triton
        )

        # The cache's attributes carry the fields' names.
        return PoolTensors(*(getattr(self, name) for name in PoolTensors._fields))

    @property
    def pool_bytes(self) -> int:
        """Bytes of the K/V pools, their scale pools (quantized caches), the K means and the
        equalization factors: what they hold in memory (keys-major pools: with their rows'
        padding to 16 keys, none at block size 1).

        Not counted: the history staging buffers and their scales (a window per layer, only
        with ``reuse_history_staging``), the per-layer flags and the host bookkeeping.
        """
        stored = (
            self.k_pools,
            self.v_pools,
            self.k_scales,
            self.v_scales,
            self.k_means,
            self.k_equalizers,
            self.v_equalizers,
            self.v_channel_scales,
        )
        return sum(t.untyped_storage().nbytes() for t in stored)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer: K and V slots and, quantized, their scales
        (keys-major pools: with their rows' padding)."""
        stored = (self.k_pools, self.v_pools, self.k_scales, self.v_scales)
        return sum(t.untyped_storage().nbytes() for t in stored) // self.num_blocks

    @property
    def pool_stats(self) -> PoolStats:
        """Managed blocks free, held by one table (exclusive) and by several (shared: forks'
        common history), the table references to them, and their bytes (``PoolStats``)."""
        return self.pool.stats(self.block_bytes)

    def session_blocks(self, session: Session) -> BlockCounts:
        """``session``'s pool blocks (every branch): held by it alone, and shared with others.

        A block shared by two branches of the one session would count as exclusive; branches
        never share blocks (a fork shares each branch with the same branch of its parent).
        """
        self.check_open(session)
        held = [
            block
            for sequence in session.sequences.values()
            for block in list.copy(sequence.block_table)
            if block != NULL_BLOCK
        ]
        shared = sum(self.pool.refcount(block) > 1 for block in held)
        return BlockCounts(exclusive=len(held) - shared, shared=shared)

    def _copy_block(self, source: int, target: int) -> None:
        """Copy-on-write: block ``source``'s K and V slots (and scales) of every layer into
        ``target``; one asynchronous device copy per tensor."""
        for pools in (self.k_pools, self.v_pools, self.k_scales, self.v_scales):
            if pools.numel():  # a float cache's scales are zero-size
                pools[:, target].copy_(pools[:, source])

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
        equalized = self.equalizers_chosen.numel() > 0
        k8v8, v_scaled = self.config.k8v8, not (self.config.k8v8 or self.config.k8v16)
        flat = not (self.config.keys_major or k8v8 or self.config.k8v16)
        return LayerCache(
            k=k,
            v=v,
            # Keys-major scales (and k8v8's V) have no flat view: flatten would copy them.
            k_flat=k.flatten(0, 1) if flat else None,
            v_flat=v.flatten(0, 1) if flat else None,
            stage_k=self.stage_k[index] if staged else None,
            stage_v=self.stage_v[index] if staged else None,
            k_scale=self.k_scales[index] if self.quantized else None,
            v_scale=self.v_scales[index] if self.quantized and v_scaled else None,
            k_mean=self.k_means[index] if self.k_means.numel() else None,
            k_mean_chosen=self.k_means_chosen[index] if self.k_means.numel() else None,
            k_equalizer=self.k_equalizers[index] if equalized else None,
            v_equalizer=self.v_equalizers[index] if equalized else None,
            equalizers_chosen=self.equalizers_chosen[index] if equalized else None,
            v_channel_scale=self.v_channel_scales[index] if k8v8 else None,
            v_scale_chosen=self.v_scales_chosen[index] if k8v8 else None,
            v_saturated=self.v_saturated[index : index + 1] if k8v8 else None,
        )

    def check_layer_state(self) -> None:
        """``ValueError`` when a layer's pools hold committed tokens but not what a layer's first
        write chooses (its K mean, its equalization factors, k8v8's V channel scales): their
        codes were written without the layer's flags, under a state nobody chose, and the next
        write would choose one from its own keys and attend the old codes under it. CPU flags:
        no device sync."""
        for flags, what in (
            (self.k_means_chosen, "K mean (k_means_chosen)"),
            (self.equalizers_chosen, "equalization factors (equalizers_chosen)"),
            (self.v_scales_chosen, "V channel scales (v_scales_chosen)"),
        ):
            if bool(flags.all()):
                continue
            sequences = (
                s for session in self.sessions.values() for s in session.sequences.values()
            )
            if not any(sequence.committed for sequence in sequences):
                return
            layer = int((~flags).nonzero()[0])
            raise ValueError(
                f"layer {layer} holds committed tokens but no chosen {what}: they were written "
                "without the layer's flags; write with layer.write_kwargs() (its first write "
                "chooses), or close the sessions that hold them"
            )

    def check_v_saturation(self) -> None:
        """``ValueError`` when a k8v8 layer stored V elements its frozen channel scales cannot
        hold (``v_saturated``: saturated beyond 448 codes, ``v_headroom`` times the first
        write's largest, or nonzero in a row stored all zeros, far below them): attention over
        that layer reads values that were not written. One device sync (the per-layer counts);
        nothing to check for other formats. ``write_slots`` counts rather than refuses, so that
        a write needs no sync; a caller checks where a sync is cheap (``PagedWanRollout``: once
        a block)."""
        if not self.v_saturated.numel():
            return
        from paged_video.kernels.value_channels import V_HEADROOM

        counts = self.v_saturated.tolist()
        layers = {layer: count for layer, count in enumerate(counts) if count}
        if layers:
            raise ValueError(
                f"k8v8 stored {sum(layers.values())} V elements its frozen channel scales cannot "
                f"hold (layer: count {layers}): beyond {V_HEADROOM:g}x the first "
                "write's largest, or rows far below the scales, which read as zeros; attention "
                "over them is not over what was written. kv_format='k8v16' keeps V unquantized"
            )

    def scratch_blocks(self, session: Session, branch: str) -> range:
        """The scratch blocks of ``session``'s sequence on ``branch``, outside the pool."""
        return self._scratch_lane(session.lane, branch)

    def _scratch_lane(self, lane: int, branch: str) -> range:
        index = lane * len(self.branches) + self.branches.index(branch)
        first = self.first_scratch_block + index * self.scratch_lane_blocks
        return range(first, first + self.scratch_lane_blocks)

    def _check_capacity(self) -> None:
        if not self._free_lanes:
            raise ValueError(
                f"session_capacity={self.session_capacity} sessions are open (forks count as "
                "sessions); close one or build the cache with a larger session_capacity"
            )

    def _add_session(self, lane: int, sequences: dict[str, Sequence]) -> Session:
        session = Session(id=self._next_session_id, lane=lane, sequences=sequences)
        self._next_session_id += 1
        self.sessions[session.id] = session
        return session

    def open_session(self) -> Session:
        """A new session with an empty sequence per branch; raises when all slots are taken."""
        self._check_capacity()
        lane = self._free_lanes.pop()
        return self._add_session(
            lane,
            {
                branch: Sequence(self.config, self.pool, self._scratch_lane(lane, branch))
                for branch in self.branches
            },
        )

    def fork(self, session: Session) -> Session:
        """A new session continuing ``session``'s committed history on every branch (a CFG
        pair forks as one): its block tables list the same blocks, one more reference each,
        and nothing is copied until a forward writes into a shared block.

        Refused (changing nothing) for a session that is closed or not this cache's, one with a
        committing forward pending on any branch (mid-forward: fork at a committed boundary),
        and when ``session_capacity`` sessions are open. Plans of ``session`` prepared before
        the fork that continue its tail block are refused afterwards (the block is shared now).
        """
        self.check_open(session)
        for branch, sequence in session.sequences.items():
            if sequence.pending is not None:
                raise ValueError(
                    f"session {session.id} is mid-forward: a committing forward is pending on "
                    f"branch {branch!r}; commit or cancel it, then fork"
                )
        self._check_capacity()
        lane = self._free_lanes.pop()
        return self._add_session(
            lane,
            {
                branch: sequence.fork(self._scratch_lane(lane, branch))
                for branch, sequence in session.sequences.items()
            },
        )

    def check_open(self, session: object) -> Session:
        """``session`` if it is open in this cache; ``TypeError``/``ValueError`` otherwise."""
        if not isinstance(session, Session):
            raise TypeError(f"session must be a Session, got {type(session).__name__}")
        if self.sessions.get(session.id) is not session:
            raise ValueError(f"session {session.id} is not open in this cache")
        return session

    def close_session(self, session: Session) -> None:
        """Drop ``session``'s references to every block of every branch (a block returns to
        the pool when no other session holds it) and free its slot."""
        self.check_open(session)
        session.close()
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
