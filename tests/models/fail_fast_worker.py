"""What each rank of ``tests/models/test_fail_fast.py`` runs: torch only (no diffusers, no
kernels), so a world starts in about a second.

Each rank runs guarded all-gathers in a loop; one rank fails in the scenario's way at round 3.
Every rank saves ``{"failed_at": wall time of the failure, "raised_at": wall time it raised,
"error": "Type: message"}`` (the failing rank before it fails) to ``out_dir/rank<r>.json``, then
leaves with ``os._exit(0)`` once the others have recorded: ``destroy_process_group`` would wait
for the abandoned collective until the process group's timeout while a stopped peer keeps its
connections open.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROUNDS = 200  # far more than run before the failure: every rank is waiting when it happens
FAIL_ROUND = 3


def run(rank: int, port: int, world_size: int, scenario: str, out_dir: str) -> None:
    from paged_video.models.distributed import all_gather
    from paged_video.models.fail_fast import FailFast

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),  # far past the test's deadline: not what stops a rank
    )
    guard = FailFast.for_world(heartbeat_s=0.25, check_s=0.1, dead_after_s=2.0)
    out = Path(out_dir) / f"rank{rank}.json"
    result = {}
    try:
        for round_ in range(ROUNDS):
            guard.where = f"round {round_}"
            if rank == world_size - 1 and round_ == FAIL_ROUND:
                result["failed_at"] = time.time()
                out.write_text(json.dumps(result))
                if scenario == "raise":
                    raise ValueError("planted failure")
                os.kill(os.getpid(), signal.SIGKILL if scenario == "kill" else signal.SIGSTOP)
            all_gather(torch.tensor([round_]), None, guard, "test all-gather")
            time.sleep(0.05)
    except Exception as error:
        result["raised_at"] = time.time()
        result["error"] = f"{type(error).__name__}: {error}"
        if rank == world_size - 1:  # the failing rank tells the others, as the rollout does
            guard.post(f"raised at {guard.where}: {result['error']}")
    out.write_text(json.dumps(result))
    # Every rank stays until all have recorded: the raising rank stays alive (its connections
    # open), so only its posted error can tell the others in time; and rank 0, which hosts the
    # store, must not take it away from a slower rank.
    store = dist.distributed_c10d._get_default_store()
    store.add("recorded", 1)
    deadline = time.monotonic() + 30
    alive = world_size if scenario == "raise" else world_size - 1
    while store.add("recorded", 0) < alive and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)
