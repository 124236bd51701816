"""What each spawned rank of ``tests/models/test_parallel.py`` runs (gloo on 127.0.0.1, CPU).

The environment is set before ``kernels`` (and so triton) is imported: the Triton interpreter,
one thread, gloo on the loopback interface. Each scenario returns a dict that the rank saves to
``out_dir/<scenario>-rank<r>.pt`` for the test process to compare.
"""

from __future__ import annotations

import os

for _name, _value in (
    ("TRITON_INTERPRET", "1"),
    ("OMP_NUM_THREADS", "1"),
    ("MKL_NUM_THREADS", "1"),
    ("OPENBLAS_NUM_THREADS", "1"),
):
    os.environ.setdefault(_name, _value)

from datetime import timedelta  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# One collective waits at most this long: a real hang fails the rank instead of blocking.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
BLOCKS = 8
GUIDANCE = 3.0


def paging_config(**overrides):
    from paged_video.paging import PagingConfig
    from tests.models.tiny import TOKENS_PER_FRAME

    settings = dict(
        block_size=16,
        chunk_size=TOKENS_PER_FRAME,
        sink_chunks=1,
        window_chunks=3,
        max_forward_chunks=1,
        max_action_tokens=0,
        exact_window=True,
    )
    settings.update(overrides)
    return PagingConfig(**settings)


# The rollouts the tests run both in one process and over two ranks.
ULYSSES = dict(config=dict(max_action_tokens=3), frames=1, actions=3, sigmas=(1.0,))
# No guidance: one row, so the history staging buffers (of the rank's heads) are reused.
UNGUIDED = dict(
    config=dict(sink_chunks=0, window_chunks=4, max_forward_chunks=2, reuse_history_staging=True),
    frames=2,
    actions=0,
    sigmas=(1.0,),
    guidance=False,
)
# Ulysses over int8 pools: each rank's K means are its heads' (every token of them is there).
ULYSSES_INT8 = dict(ULYSSES, config=dict(ULYSSES["config"], kv_dtype=torch.int8))
# Ulysses over k8v8 pools: each rank's frozen V channel scales are its heads' (sharded with them).
ULYSSES_K8V8 = dict(ULYSSES, config=dict(ULYSSES["config"], kv_format="k8v8"))
CFG = dict(
    config=dict(block_size=16, window_chunks=4, max_forward_chunks=2, reuse_history_staging=True),
    frames=2,
    actions=0,
    sigmas=(1.0,),
)


CHOSEN = ("k_means", "k_equalizers", "v_equalizers", "v_channel_scales")


def widen_channels(model) -> None:
    """Channels 0-3 of every self-attention head's K and V 16x wider (the outlier channels that
    channel equalization evens out; pairs of channels, so the rotary turns them alike)."""
    with torch.no_grad():
        for block in model.blocks:
            attn = block.attn1
            wide = attn.norm_k.weight.unflatten(0, (attn.heads, -1))[:, :4]
            wide.mul_(16)
            for tensor in (attn.to_v.weight, attn.to_v.bias):
                tensor.unflatten(0, (attn.heads, -1))[:, :4].mul_(16)


def rollout(case: dict, rollout_factory, on_block=None):
    """Run ``case`` with ``rollout_factory(model, config)``; the latents, reads and pool bytes."""
    from tests.models.tiny import poison, rollout_inputs, tiny_wan

    model = tiny_wan(0)
    if case.get("wide_channels"):
        widen_channels(model)
    blocks = case.get("blocks", BLOCKS)
    inputs = rollout_inputs(case["frames"], blocks=blocks, action_tokens=max(1, case["actions"]))
    config = paging_config(**case["config"])
    with rollout_factory(model, config, guidance=case.get("guidance", True)) as paged:
        poison(paged.cache)  # a read of an unwritten slot shows as NaN
        result = paged.generate(
            inputs.noise,
            inputs.prompt,
            inputs.negative if paged.guided else None,
            frames_per_block=case["frames"],
            sigmas=case["sigmas"],
            guidance_scale=GUIDANCE,
            actions=inputs.actions if case["actions"] else None,
            on_block=on_block,
        )
        cache = paged.cache
        # What a quantized cache chose on each layer's first write (zero-size: nothing).
        chosen = {name: getattr(cache, name).clone() for name in CHOSEN}
        return chosen | {
            "latents": result.latents,
            "positions": [
                [dict(read.positions) for read in block_reads] for block_reads in result.reads
            ],
            "kv_format": config.kv_format,
            "pool_bytes": cache.pool_bytes,
            "num_blocks": cache.num_blocks,
            "kv_heads": cache.k_pools.shape[3],
            "branches": paged.branches,
            "stage_from": [[read.stage_from for read in reads] for reads in result.reads],
        }


def _two(rank: int) -> dict:
    """Ulysses P=2, CFG parallel, and two planted divergences (a config, a stolen block)."""
    from paged_video.models.parallel import ParallelGroups, ParallelLayout, ParallelWanRollout

    ulysses = ParallelGroups(ParallelLayout(ulysses_degree=2))
    cfg = ParallelGroups(ParallelLayout(cfg_degree=2))
    results = {
        "ulysses": rollout(ULYSSES, partial(ParallelWanRollout, groups=ulysses)),
        "ulysses_int8": rollout(ULYSSES_INT8, partial(ParallelWanRollout, groups=ulysses)),
        "ulysses_k8v8": rollout(ULYSSES_K8V8, partial(ParallelWanRollout, groups=ulysses)),
        "unguided": rollout(UNGUIDED, partial(ParallelWanRollout, groups=ulysses)),
        "cfg": rollout(CFG, partial(ParallelWanRollout, groups=cfg)),
    }

    def diverged(case, factory, on_block=None) -> str:
        try:
            rollout(case, factory, on_block)
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return "no error"

    # Rank 1 keeps a window of 4 frames, rank 0 of 3.
    wider = dict(ULYSSES, config=dict(ULYSSES["config"], window_chunks=3 + rank))
    results["config_diverged"] = diverged(wider, partial(ParallelWanRollout, groups=ulysses))

    # Rank 1 takes a pool block after block 0: from block 1's commit on its block ids differ.
    holder = {}

    def factory(model, config, **kwargs):
        holder["rollout"] = ParallelWanRollout(model, config, ulysses, **kwargs)
        return holder["rollout"]

    def steal(block: int) -> None:
        if rank == 1 and block == 0:
            holder["rollout"].cache.pool.allocate(1)

    results["block_diverged"] = diverged(ULYSSES, factory, steal)
    results["refused"] = refusals(ulysses, cfg)
    return results


def refusals(ulysses, cfg) -> list[tuple[str, str, bool]]:
    """Rollouts the layout cannot carry: (error, message, model left stock?) for each."""
    from paged_video.models.parallel import ParallelWanRollout
    from tests.models.tiny import tiny_wan

    cases = [
        (tiny_wan(num_attention_heads=3, attention_head_dim=16), paging_config(), ulysses, {}),
        (tiny_wan(), paging_config(chunk_size=25), ulysses, {}),
        (tiny_wan(), paging_config(), cfg, {"guidance": False}),
    ]
    out = []
    for model, config, groups, kwargs in cases:
        try:
            ParallelWanRollout(model, config, groups, **kwargs)
        except (TypeError, ValueError) as error:
            stock = type(model.blocks[0].attn1.processor).__name__ == "WanAttnProcessor"
            out.append((type(error).__name__, str(error), stock))
        else:
            out.append(("no error", "", False))
    return out


def _four(rank: int) -> dict:
    """Ulysses x CFG with P=4: the groups, and the Ulysses all-to-alls within them (torch only,
    no diffusers or kernels imported: four ranks on two cores stay cheap)."""
    from paged_video.models.distributed import (
        ParallelGroups,
        ParallelLayout,
        heads_to_sequence,
        sequence_to_heads,
    )

    groups = ParallelGroups(ParallelLayout(ulysses_degree=2, cfg_degree=2))
    members = {}
    for name, group in (("ulysses", groups.ulysses), ("cfg", groups.cfg)):
        gathered = [torch.zeros((), dtype=torch.int64) for _ in range(2)]
        dist.all_gather(gathered, torch.tensor(rank), group=group)
        members[name] = [int(r) for r in gathered]
    # q/k/v of 2 rows, 8 tokens, 4 heads of 5, one tensor per CFG branch; each rank its shard.
    full = torch.randn(3, 2, 8, 4, 5, generator=torch.Generator().manual_seed(groups.cfg_index))
    shard = full.chunk(2, dim=2)[groups.ulysses_index]
    heads = sequence_to_heads(shard, groups.ulysses, 2)
    return {
        "members": members,
        "coordinates": (groups.cfg_index, groups.ulysses_index),
        "full": full,
        "shard": shard,
        "heads": heads,
        "back": heads_to_sequence(heads[0], groups.ulysses, 2),
    }


# Ulysses x CFG rollout: two blocks, the second reading the first's committed frame.
FOUR = dict(ULYSSES, config=dict(ULYSSES["config"], window_chunks=2, sink_chunks=0), blocks=2)


def _four_rollout(rank: int) -> dict:
    """A Ulysses x CFG rollout on 4 ranks (opt-in: four diffusers imports on two cores)."""
    from paged_video.models.parallel import ParallelLayout, ParallelWanRollout

    layout = ParallelLayout(ulysses_degree=2, cfg_degree=2)
    return rollout(FOUR, partial(ParallelWanRollout, groups=layout))


SCENARIOS = {"two": _two, "four": _four, "four_rollout": _four_rollout}


def run(rank: int, port: int, world_size: int, scenario: str, out_dir: str) -> None:
    """The entry point of ``torch.multiprocessing.spawn``."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        results = SCENARIOS[scenario](rank)
        torch.save(results, Path(out_dir) / f"{scenario}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()
