"""``torch.distributed`` plumbing of ``models.parallel``: no diffusers, no kernels.

The rank layout and its process groups (Ulysses x sequence-sharded window x CFG), the
collectives (the Ulysses all-to-alls, the window shards' chunk gather and partial-output
exchange), every one waited for through ``models.fail_fast`` when a guard is given, the digests
that make diverged ranks fail together, and a traffic log of the collectives' real tensor sizes.
Importing this module costs only torch, so tests that only need the groups stay cheap.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from paged_video.models.fail_fast import FailFast

if TYPE_CHECKING:
    from paged_video.paging.forward import ForwardCall


class PlanDivergenceError(RuntimeError):
    """The ranks of a parallel rollout disagree: other paging plans for the same forward, other
    rollout arguments, or another end."""


class RankCoordinates(NamedTuple):
    """Where a rank sits in a ``ParallelLayout``."""

    cfg: int
    kv_shard: int
    ulysses: int


@dataclass(frozen=True)
class ParallelLayout:
    """Which ranks form the Ulysses, window-shard, CFG and sequence groups; a pure function of
    the degrees.

    ``world_size = cfg_degree * kv_shard_degree * ulysses_degree``. Rank
    ``r = (c * kv_shard_degree + s) * ulysses_degree + u`` is CFG branch ``c`` (0: positive,
    1: negative text), window shard ``s`` and Ulysses rank ``u``. A Ulysses group is
    ``ulysses_degree`` consecutive ranks (on one node under torchrun, where the all-to-alls
    are); a window-shard group strides by ``ulysses_degree``; a CFG group by
    ``kv_shard_degree * ulysses_degree``. A *sequence* group is every rank of one CFG branch:
    the forward's tokens are split over it in rank order (token shard ``s * ulysses_degree +
    u``).
    """

    ulysses_degree: int = 1
    cfg_degree: int = 1
    kv_shard_degree: int = 1

    def __post_init__(self) -> None:
        for name in ("ulysses_degree", "cfg_degree", "kv_shard_degree"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.cfg_degree > 2:
            raise ValueError(f"cfg_degree must be 1 or 2 (two CFG branches), got {self.cfg_degree}")

    @property
    def world_size(self) -> int:
        return self.ulysses_degree * self.cfg_degree * self.kv_shard_degree

    @property
    def sequence_degree(self) -> int:
        """Ranks sharing one CFG branch's tokens: ``kv_shard_degree * ulysses_degree``."""
        return self.ulysses_degree * self.kv_shard_degree

    def _rank(self, cfg: int, kv_shard: int, ulysses: int) -> int:
        return (cfg * self.kv_shard_degree + kv_shard) * self.ulysses_degree + ulysses

    def ulysses_groups(self) -> list[list[int]]:
        return [
            [self._rank(c, s, u) for u in range(self.ulysses_degree)]
            for c in range(self.cfg_degree)
            for s in range(self.kv_shard_degree)
        ]

    def kv_shard_groups(self) -> list[list[int]]:
        return [
            [self._rank(c, s, u) for s in range(self.kv_shard_degree)]
            for c in range(self.cfg_degree)
            for u in range(self.ulysses_degree)
        ]

    def cfg_groups(self) -> list[list[int]]:
        return [
            [self._rank(c, s, u) for c in range(self.cfg_degree)]
            for s in range(self.kv_shard_degree)
            for u in range(self.ulysses_degree)
        ]

    def sequence_groups(self) -> list[list[int]]:
        per_branch = self.sequence_degree
        return [list(range(c * per_branch, (c + 1) * per_branch)) for c in range(self.cfg_degree)]

    def coordinates(self, rank: int) -> RankCoordinates:
        """``(cfg, kv_shard, ulysses)`` indices of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        cfg, rest = divmod(rank, self.sequence_degree)
        return RankCoordinates(cfg, *divmod(rest, self.ulysses_degree))


class ParallelGroups:
    """This rank's process groups for a ``ParallelLayout`` over the default (world) group.

    Every rank must build it, in the same order relative to other ``new_group`` calls (as
    ``torch.distributed.new_group`` requires). ``ulysses``, ``kv_shard``, ``cfg`` and
    ``sequence`` are None for degree 1 (``sequence`` is the Ulysses or window-shard group when
    the other degree is 1). ``guard`` is the world's ``FailFast`` (heartbeats start here).
    """

    def __init__(self, layout: ParallelLayout) -> None:
        if not isinstance(layout, ParallelLayout):
            raise TypeError(f"layout must be a ParallelLayout, got {type(layout).__name__}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ParallelGroups needs torch.distributed.init_process_group first")
        world = dist.get_world_size()
        if world != layout.world_size:
            raise ValueError(
                f"the world has {world} ranks, the layout needs ulysses_degree * cfg_degree * "
                f"kv_shard_degree = {layout.world_size}"
            )
        self.layout = layout
        self.rank = dist.get_rank()
        self.cfg_index, self.kv_shard_index, self.ulysses_index = layout.coordinates(self.rank)
        self.guard = FailFast.for_world()
        self.ulysses = self._own(layout.ulysses_groups(), layout.ulysses_degree)
        self.kv_shard = self._own(layout.kv_shard_groups(), layout.kv_shard_degree)
        self.cfg = self._own(layout.cfg_groups(), layout.cfg_degree)
        if layout.kv_shard_degree == 1:
            self.sequence = self.ulysses
        elif layout.ulysses_degree == 1:
            self.sequence = self.kv_shard
        else:
            self.sequence = self._own(layout.sequence_groups(), layout.sequence_degree)
        self.sequence_index = self.kv_shard_index * layout.ulysses_degree + self.ulysses_index

    def _own(self, ranks_of_groups: list[list[int]], degree: int) -> dist.ProcessGroup | None:
        """Create every group (all ranks must), keep the one holding this rank."""
        if degree == 1:
            return None
        own = None
        for ranks in ranks_of_groups:
            group = dist.new_group(ranks)
            if self.rank in ranks:
                own = group
        return own


@dataclass(frozen=True)
class Transfer:
    """One collective as this rank saw it: its name, the group's size, and the bytes this rank
    sent to and received from *other* ranks (its own share excluded)."""

    name: str
    group_size: int
    sent: int
    received: int


_traffic: list[Transfer] | None = None


@contextlib.contextmanager
def record_traffic() -> Iterator[list[Transfer]]:
    """Log every collective of this module (their real tensors' sizes) while the block runs."""
    global _traffic
    outer, _traffic = _traffic, []
    try:
        yield _traffic
    finally:
        _traffic = outer


def _log(name: str, group: dist.ProcessGroup | None, sent: int, received: int) -> None:
    if _traffic is not None:
        _traffic.append(Transfer(name, dist.get_world_size(group), sent, received))


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _finish(
    work: dist.Work | None, guard: FailFast | None, what: str, tensor: Tensor, host: bool
) -> None:
    if guard is not None:
        guard.wait(work, what, cuda=tensor.device.type == "cuda", host=host)


def all_gather(
    tensor: Tensor,
    group: dist.ProcessGroup | None,
    guard: FailFast | None,
    what: str,
    *,
    host: bool = False,
) -> Tensor:
    """``(ranks, *tensor.shape)``: every rank's ``tensor`` in group-rank order.

    Waited for through ``guard`` when given, else blocking. ``host``: the caller reads the
    result on the host at once (CUDA tensors: wait for it, not only order the stream).
    """
    size = dist.get_world_size(group)
    tensor = tensor.contiguous()
    gathered = [torch.empty_like(tensor) for _ in range(size)]
    _log(what, group, (size - 1) * _nbytes(tensor), (size - 1) * _nbytes(tensor))
    work = dist.all_gather(gathered, tensor, group=group, async_op=guard is not None)
    _finish(work, guard, what, tensor, host)
    return torch.stack(gathered)


def all_to_all(
    send: Tensor, group: dist.ProcessGroup | None, guard: FailFast | None, what: str
) -> Tensor:
    """``received[j]`` = rank ``j``'s ``send[this rank]``: ``send`` is ``(ranks, ...)``."""
    size = dist.get_world_size(group)
    send = send.contiguous()
    received = torch.empty_like(send)
    share = _nbytes(send) // size
    _log(what, group, (size - 1) * share, (size - 1) * share)
    work = dist.all_to_all_single(received, send, group=group, async_op=guard is not None)
    _finish(work, guard, what, send, host=False)
    return received


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where small host-side words (digests) must live to go through ``group``'s backend."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "cpu" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def plan_digest(call: ForwardCall) -> Tensor:
    """Three int64 words identifying a prepared forward: what every rank must agree on.

    Two position-weighted sums (weights below 2**31, so no overflow) over the block table, the
    lengths, the slots, the key gaps (exact window), the staging decision and each plan's
    history, size, commit flag and action count, and the number of words. On the inputs' device:
    no host sync until the comparison.
    """
    inputs = call.inputs
    parts = [
        inputs.block_table,
        inputs.seq_lens_k,
        inputs.cu_seqlens_q,
        inputs.video_slots,
        inputs.action_slots,
    ]
    if inputs.exact_window:
        parts.append(inputs.key_gap)
    device = inputs.block_table.device
    header = [call.stage_from, int(inputs.exact_window), *inputs.block_table.shape]
    for plan in call.plans:
        header += [plan.history, plan.num_tokens, int(plan.committing), plan.action_tokens]
    words = torch.cat(
        [torch.tensor(header, dtype=torch.int64, device=device)]
        + [part.reshape(-1).to(torch.int64) for part in parts]
    )
    index = torch.arange(words.numel(), dtype=torch.int64, device=device)
    modulus = 2**31 - 1
    first = (words * ((index * 48271 + 1) % modulus)).sum()
    second = (words * ((index * 69621 + 7) % modulus + 1)).sum()
    return torch.stack([first, second, torch.tensor(words.numel(), device=device)])


def check_plans_agree(
    call: ForwardCall,
    group: dist.ProcessGroup | None,
    where: str,
    guard: FailFast | None = None,
) -> None:
    """All-gather ``plan_digest(call)`` over ``group``; raise on every rank when they differ.

    One collective every rank reaches (the digest has a fixed size whatever the plan's shapes),
    so a diverged rank is an error everywhere, never a hang in a later all-to-all.
    """
    digests = all_gather(plan_digest(call), group, guard, f"plan digest at {where}", host=True)
    digests = digests.cpu()
    differ = (digests != digests[0]).any(dim=1).nonzero().flatten().tolist()
    if differ:
        raise PlanDivergenceError(
            f"paging plans diverged across ranks at {where}: ranks {differ} differ from rank 0 "
            f"(digests {digests.tolist()}); every rank must run the same configuration and the "
            "same sequence of forwards"
        )


def value_digest(value: object) -> int:
    """A 64-bit digest of a tensor's shape, dtype and bytes, or of another value's ``repr``."""
    digest = hashlib.blake2b(digest_size=8)
    if isinstance(value, Tensor):
        digest.update(f"{tuple(value.shape)} {value.dtype}".encode())
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        digest.update(data.numpy().tobytes())
    else:
        digest.update(repr(value).encode())
    return int.from_bytes(digest.digest(), "little", signed=True)


def check_values_agree(
    values: Mapping[str, object],
    group: dist.ProcessGroup | None,
    where: str,
    guard: FailFast | None = None,
) -> None:
    """All-gather one ``value_digest`` per named value; on every rank, ``PlanDivergenceError``
    naming each value some rank holds differently. Every rank must pass the same names."""
    names = list(values)
    words = torch.tensor(
        [value_digest(values[name]) for name in names],
        dtype=torch.int64,
        device=collective_device(group),
    )
    gathered = all_gather(words, group, guard, f"agreement check at {where}", host=True).cpu()
    differ = gathered != gathered[0]
    if differ.any():
        named = [
            f"{name} (ranks {differ[:, i].nonzero().flatten().tolist()})"
            for i, name in enumerate(names)
            if differ[:, i].any()
        ]
        raise PlanDivergenceError(
            f"the ranks disagree at {where}: {', '.join(named)} differ from rank 0's; every "
            "rank must call generate with the same arguments and configuration"
        )


def sequence_to_heads(
    qkv: Tensor, group: dist.ProcessGroup, degree: int, guard: FailFast | None = None
) -> Tensor:
    """``(3, rows, s, H, D)`` shard of the sequence -> ``(3, rows, degree * s, H / degree, D)``."""
    send = qkv.unflatten(3, (degree, -1)).permute(3, 0, 1, 2, 4, 5)
    received = all_to_all(send, group, guard, "Ulysses all-to-all (q, k, v)")
    return received.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)  # received[j]: rank j's tokens


def heads_to_sequence(
    out: Tensor, group: dist.ProcessGroup, degree: int, guard: FailFast | None = None
) -> Tensor:
    """``(rows, n, H / degree, D)`` of every token -> ``(rows, n / degree, H, D)`` of the shard."""
    send = out.unflatten(1, (degree, -1)).permute(1, 0, 2, 3, 4)
    received = all_to_all(send, group, guard, "Ulysses all-to-all (output)")
    return received.permute(1, 2, 0, 3, 4).flatten(2, 3)  # received[j]: rank j's heads


def gather_chunk(qkv: Tensor, group: dist.ProcessGroup, guard: FailFast | None = None) -> Tensor:
    """``(3, rows, n / S, H, D)`` of this window shard's token slice -> ``(3, rows, n, H, D)``:
    every slice of the forward's tokens, in shard order (which is token order)."""
    gathered = all_gather(qkv, group, guard, "window-shard gather (q, k, v)")
    return gathered.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)


def pack_states(out: Tensor, lse: Tensor) -> Tensor:
    """``out (T, H, D)`` and float32 ``lse (T, H)`` as one ``(T, H, D + e)`` tensor of
    ``out``'s dtype (the LSE's bits in the last ``e = 4 / itemsize`` columns): one message."""
    bits = lse.to(torch.float32).unsqueeze(-1).contiguous().view(out.dtype)
    return torch.cat([out, bits], dim=-1)


def unpack_states(states: Tensor, head_dim: int) -> tuple[Tensor, Tensor]:
    """``pack_states``' inverse on stacked states ``(..., H, D + e)``: ``(out, lse)`` with
    ``out`` a view, ``lse`` float32 ``(..., H)``."""
    bits = states[..., head_dim:].contiguous()
    return states[..., :head_dim], bits.view(torch.float32).squeeze(-1)


def exchange_partials(
    states: Tensor, group: dist.ProcessGroup, degree: int, guard: FailFast | None = None
) -> Tensor:
    """``(rows, n, H, E)`` partial states of every token over this shard's keys ->
    ``(degree, rows, n / degree, H, E)``: every shard's partial state of this rank's slice."""
    send = states.unflatten(1, (degree, -1)).transpose(0, 1)
    return all_to_all(send, group, guard, "window-shard exchange (partial outputs, LSE)")
