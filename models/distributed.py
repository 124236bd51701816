"""``torch.distributed`` plumbing of ``models.parallel``: no diffusers, no kernels.

The rank layout and its process groups (Ulysses x CFG), the two Ulysses all-to-alls, and the
per-forward plan digest that makes diverged ranks fail together. Importing this module costs
only torch, so tests that only need the groups stay cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from paged_video.paging.forward import ForwardCall


class PlanDivergenceError(RuntimeError):
    """The ranks of a parallel rollout built different paging plans for the same forward."""


@dataclass(frozen=True)
class ParallelLayout:
    """Which ranks form the Ulysses and the CFG groups; a pure function of the degrees.

    Rank ``r`` has CFG index ``r // ulysses_degree`` (0: positive, 1: negative text) and Ulysses
    index ``r % ulysses_degree``, so a Ulysses group is ``ulysses_degree`` consecutive ranks
    (on one node under torchrun, where the all-to-alls are) and a CFG group strides across them.
    """

    ulysses_degree: int = 1
    cfg_degree: int = 1

    def __post_init__(self) -> None:
        for name in ("ulysses_degree", "cfg_degree"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.cfg_degree > 2:
            raise ValueError(f"cfg_degree must be 1 or 2 (two CFG branches), got {self.cfg_degree}")

    @property
    def world_size(self) -> int:
        return self.ulysses_degree * self.cfg_degree

    def ulysses_groups(self) -> list[list[int]]:
        u = self.ulysses_degree
        return [[c * u + i for i in range(u)] for c in range(self.cfg_degree)]

    def cfg_groups(self) -> list[list[int]]:
        u = self.ulysses_degree
        return [[c * u + i for c in range(self.cfg_degree)] for i in range(u)]

    def coordinates(self, rank: int) -> tuple[int, int]:
        """``(cfg_index, ulysses_index)`` of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return divmod(rank, self.ulysses_degree)


class ParallelGroups:
    """This rank's process groups for a ``ParallelLayout`` over the default (world) group.

    Every rank must build it, in the same order relative to other ``new_group`` calls (as
    ``torch.distributed.new_group`` requires). ``ulysses`` / ``cfg`` are None for degree 1.
    """

    def __init__(self, layout: ParallelLayout) -> None:
        if not isinstance(layout, ParallelLayout):
            raise TypeError(f"layout must be a ParallelLayout, got {type(layout).__name__}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ParallelGroups needs torch.distributed.init_process_group first")
        world = dist.get_world_size()
        if world != layout.world_size:
            raise ValueError(
                f"the world has {world} ranks, the layout needs ulysses_degree * cfg_degree = "
                f"{layout.world_size}"
            )
        self.layout = layout
        self.rank = dist.get_rank()
        self.cfg_index, self.ulysses_index = layout.coordinates(self.rank)
        self.ulysses = self._own(layout.ulysses_groups(), layout.ulysses_degree)
        self.cfg = self._own(layout.cfg_groups(), layout.cfg_degree)

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


def check_plans_agree(call: ForwardCall, group: dist.ProcessGroup | None, where: str) -> None:
    """All-gather ``plan_digest(call)`` over ``group``; raise on every rank when they differ.

    One collective every rank reaches (the digest has a fixed size whatever the plan's shapes),
    so a diverged rank is an error everywhere, never a hang in a later all-to-all.
    """
    digest = plan_digest(call)
    gathered = [torch.empty_like(digest) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, digest, group=group)
    digests = torch.stack(gathered).cpu()
    differ = (digests != digests[0]).any(dim=1).nonzero().flatten().tolist()
    if differ:
        raise PlanDivergenceError(
            f"paging plans diverged across ranks at {where}: ranks {differ} differ from rank 0 "
            f"(digests {digests.tolist()}); every rank must run the same configuration and the "
            "same sequence of forwards"
        )


def sequence_to_heads(qkv: Tensor, group: dist.ProcessGroup, degree: int) -> Tensor:
    """``(3, rows, s, H, D)`` shard of the sequence -> ``(3, rows, degree * s, H / degree, D)``."""
    send = qkv.unflatten(3, (degree, -1)).permute(3, 0, 1, 2, 4, 5).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # received[j]: rank j's tokens
    return received.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)


def heads_to_sequence(out: Tensor, group: dist.ProcessGroup, degree: int) -> Tensor:
    """``(rows, n, H / degree, D)`` of every token -> ``(rows, n / degree, H, D)`` of the shard."""
    send = out.unflatten(1, (degree, -1)).permute(1, 0, 2, 3, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # received[j]: rank j's heads
    return received.permute(1, 2, 0, 3, 4).flatten(2, 3)
