"""What each rank of ``tests/models/test_fail_fast.py`` runs: torch only (no diffusers, no
kernels), so a world starts in about a second.

Each rank runs guarded all-gathers in a loop; the last rank stops itself (``SIGSTOP``) at round
3: alive, its connections open, only its heartbeats stop. Every rank saves ``{"failed_at": wall
time of the stop, "raised_at": wall time it raised, "error": "Type: message"}`` (the stopping
rank before it stops) to ``out_dir/rank<r>.json``, then leaves with ``os._exit(0)`` once the
others have recorded: ``destroy_process_group`` would wait for the abandoned collective until
the process group's timeout while the stopped peer keeps its connections open.
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

from tests.models import ranks

ROUNDS = 200  # far more than run before the failure: every rank is waiting when it happens
FAIL_ROUND = 3


def run(rank: int, port: int, world_size: int, out_dir: str) -> None:
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
                os.kill(os.getpid(), signal.SIGSTOP)
            all_gather(torch.tensor([round_]), None, guard, "test all-gather")
            time.sleep(0.05)
    except Exception as error:
        result["raised_at"] = time.time()
        result["error"] = f"{type(error).__name__}: {error}"
    out.write_text(json.dumps(result))
    ranks.leave_together(rank, alive=world_size - 1)  # the stopped rank never arrives
