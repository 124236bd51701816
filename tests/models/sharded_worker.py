"""What each rank of ``tests/models/test_sharded_window.py`` runs (gloo on 127.0.0.1, CPU).

The kernels take their plain-PyTorch path (``TRITON_INTERPRET=0``, set by the test before the
ranks start): these tests check how the window is split, gathered and merged across ranks, the
kernels are checked against the oracle elsewhere (and, interpreted, under one process, in
``tests/paging/test_shard_attention.py``). Each rank saves a dict to
``out_dir/<scenario>-rank<r>.pt``; the last part of each scenario poisons the world (a rank
raises, or is killed), so a rank saves before that part starts, again after it, and leaves
with ``os._exit(0)`` once every live rank has saved.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from tests.models import ranks
from tests.models.parallel_worker import CFG, GUIDANCE, ULYSSES, UNGUIDED, rollout

# A slower rank is not a dead one: far past the heartbeats' verdict and the test's deadline.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
# The window slides from block 3 on and compacts (24-token frames over 16-token blocks).
SHARDED = ULYSSES
# Staging, two frames (three whole blocks) per block and no actions: each committing forward
# restages only its own blocks, on each rank its own of them.
SHARDED_KEPT = UNGUIDED
# No exact window (whole-block reads add boundary tokens), staging, two frames per block.
SHARDED_STAGED = dict(
    CFG,
    config=dict(CFG["config"], exact_window=False, sink_chunks=1, max_action_tokens=3),
    actions=3,
    guidance=False,
    blocks=6,
)
# Quantized pools, K smoothing and channel equalization on: every rank must freeze the single
# process's K mean and factors (chosen from every token of each layer's first forward).
SHARDED_INT8 = dict(
    SHARDED, config=dict(SHARDED["config"], kv_dtype=torch.int8), wide_channels=True
)
# The one switch's 8-bit formats: int8 K (smoothed, equalized) with k8v8's e4m3 V of frozen
# channel scales (chosen from every token of a layer's first forward, as the K mean) or k8v16's
# 16-bit V.
SHARDED_K8V8 = dict(SHARDED, config=dict(SHARDED["config"], kv_format="k8v8"), wide_channels=True)
SHARDED_K8V16 = dict(SHARDED_K8V8, config=dict(SHARDED["config"], kv_format="k8v16"))
FAIL_BLOCK = 2


def _attempt(call) -> dict:
    """``call()``'s error (``"Type: message"``) and when it was raised (wall time), or none."""
    started = time.time()
    try:
        call()
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}", "at": time.time(), "from": started}
    return {"error": "no error", "at": time.time(), "from": started}


def _diverged(
    rank: int, groups, *, blocks: int = 2, height: int = 8, guidance: float = GUIDANCE
) -> dict:
    """A two-block sharded rollout in which rank 1 passes other arguments to ``generate``:
    ``blocks`` blocks, noise ``height`` latent rows, ``guidance`` scale."""
    from paged_video.models.parallel import ParallelWanRollout
    from paged_video.paging import PagingConfig
    from tests.models.tiny import rollout_inputs, tiny_wan

    if rank != 1:
        blocks, height, guidance = 2, 8, GUIDANCE
    inputs = rollout_inputs(1, blocks=blocks)
    config = PagingConfig(block_size=16, chunk_size=24, window_chunks=2)
    with ParallelWanRollout(tiny_wan(0), config, groups) as paged:
        return _attempt(
            lambda: paged.generate(
                inputs.noise[:, :, :, :height],
                inputs.prompt,
                inputs.negative,
                frames_per_block=1,
                sigmas=(1.0,),
                guidance_scale=guidance,
            )
        )


def _fail_at(rank: int, failing_rank: int, how: str, groups, out: Path, results: dict) -> dict:
    """A sharded rollout in which ``failing_rank`` raises (``how="raise"``) or is killed at
    block ``FAIL_BLOCK``; the others' error and when they raised."""
    from paged_video.models.parallel import ParallelWanRollout

    def on_block(block: int) -> None:
        if rank == failing_rank and block == FAIL_BLOCK:
            results["failed_at"] = time.time()
            torch.save(results, out)
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"planted failure at block {block}")

    return _attempt(lambda: rollout(SHARDED, partial(ParallelWanRollout, groups=groups), on_block))


def _two(rank: int, out: Path) -> dict:
    """Window shards over 2 ranks (float, int8, k8v8, k8v16); planted divergences; rank 1
    raising mid-rollout (last)."""
    from paged_video.models.parallel import ParallelGroups, ParallelLayout, ParallelWanRollout

    groups = ParallelGroups(ParallelLayout(kv_shard_degree=2))
    factory = partial(ParallelWanRollout, groups=groups)
    results = {
        "sharded": rollout(SHARDED, factory),
        "staged": rollout(SHARDED_STAGED, factory),
        "kept": rollout(SHARDED_KEPT, factory),
        "int8": rollout(SHARDED_INT8, factory),
        "k8v8": rollout(SHARDED_K8V8, factory),
        "k8v16": rollout(SHARDED_K8V16, factory),
        "one_more_block": _diverged(rank, groups, blocks=3),
        "other_guidance": _diverged(rank, groups, guidance=GUIDANCE + 1),
        "other_noise_shape": _diverged(rank, groups, height=6),
    }
    results["raised"] = _fail_at(rank, 1, "raise", groups, out, results)
    return results


def _four(rank: int, out: Path) -> dict:
    """Ulysses 2 x window shards 2 (float, k8v16), CFG 2 x window shards 2 (float, int8,
    k8v8, k8v16), window shards 4 (int8), Ulysses 2 x CFG 2 (int8, k8v8, k8v16); rank 3 killed
    mid-rollout (last)."""
    from paged_video.models.parallel import ParallelGroups, ParallelLayout, ParallelWanRollout

    by_heads = ParallelGroups(ParallelLayout(ulysses_degree=2, kv_shard_degree=2))
    by_branch = ParallelGroups(ParallelLayout(cfg_degree=2, kv_shard_degree=2))
    by_window = ParallelGroups(ParallelLayout(kv_shard_degree=4))
    by_both = ParallelGroups(ParallelLayout(ulysses_degree=2, cfg_degree=2))
    results = {
        "ulysses": rollout(SHARDED, partial(ParallelWanRollout, groups=by_heads)),
        "cfg": rollout(SHARDED, partial(ParallelWanRollout, groups=by_branch)),
        "shards_int8": rollout(SHARDED_INT8, partial(ParallelWanRollout, groups=by_window)),
        "cfg_int8": rollout(SHARDED_INT8, partial(ParallelWanRollout, groups=by_branch)),
        "ulysses_cfg_int8": rollout(SHARDED_INT8, partial(ParallelWanRollout, groups=by_both)),
        "cfg_k8v8": rollout(SHARDED_K8V8, partial(ParallelWanRollout, groups=by_branch)),
        "cfg_k8v16": rollout(SHARDED_K8V16, partial(ParallelWanRollout, groups=by_branch)),
        "ulysses_k8v16": rollout(SHARDED_K8V16, partial(ParallelWanRollout, groups=by_heads)),
        "ulysses_cfg_k8v8": rollout(SHARDED_K8V8, partial(ParallelWanRollout, groups=by_both)),
        "ulysses_cfg_k8v16": rollout(SHARDED_K8V16, partial(ParallelWanRollout, groups=by_both)),
    }
    results["killed"] = _fail_at(rank, 3, "kill", by_heads, out, results)
    return results


SCENARIOS = {"two": _two, "four": _four}


def run(rank: int, port: int, world_size: int, scenario: str, out_dir: str) -> None:
    """The entry point of each spawned rank."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    out = Path(out_dir) / f"{scenario}-rank{rank}.pt"
    torch.save(SCENARIOS[scenario](rank, out), out)
    ranks.leave_together(rank, alive=world_size - (scenario == "four"))  # one was killed
