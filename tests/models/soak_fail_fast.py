"""Soak of ``models.fail_fast`` under CPU load: healthy worlds must never fail, planted failures
must still be caught within seconds. A script, not part of the test run (minutes of CPU)::

    python -m tests.models.soak_fail_fast --worlds 30 --planted 6

``--worlds`` healthy worlds, 2 and 4 ranks in turn (gloo on 127.0.0.1), each rank running
``--rounds`` guarded all-gathers with random pauses of up to 3 ``check_s`` before each, so its
waits keep timing out slice after slice while the collectives complete at any moment (the race
of a slice's timeout with the completion); a rank that raises there is a false failure. Then
``--planted`` worlds whose last rank fails at round 5, by turns raising (its error posted),
killed (``SIGKILL``) and stopped (``SIGSTOP``, only the heartbeats tell): every other rank must
raise ``RankFailedError`` within ``CAUGHT_WITHIN_S`` of the failure. ``--stress`` busy
processes load the CPU throughout. Prints one line per world and the totals; exits 1 on a false
failure, a hang or a planted failure caught late or not at all.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest

from tests.models import ranks

CAUGHT_WITHIN_S = 10.0
FAIL_ROUND = 5
FAILURES = ("raise", "kill", "stop")
# Heartbeats: a stopped rank is declared dead after DEAD_AFTER_S, well inside CAUGHT_WITHIN_S;
# under load a live rank's heartbeat thread still beats many times in that span.
HEARTBEAT_S, DEAD_AFTER_S = 0.25, 4.0
WORLD_DEADLINE_S = 180.0


def run(rank: int, port: int, world_size: int, out_dir: str, plan: dict) -> None:
    """One rank: guarded all-gathers with random pauses; the planted failure if it is ours."""
    import torch
    import torch.distributed as dist

    from paged_video.models.distributed import all_gather
    from paged_video.models.fail_fast import FailFast

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=150),  # far past CAUGHT_WITHIN_S: not what stops a rank
    )
    timed_out = 0
    wait_for = FailFast._wait_for

    def counting_wait_for(work, timeout):  # counts the slices that timed out; same outcome
        nonlocal timed_out
        done = wait_for(work, timeout)
        timed_out += not done
        return done

    FailFast._wait_for = staticmethod(counting_wait_for)
    check_s = plan["check_s"]
    guard = FailFast.for_world(heartbeat_s=HEARTBEAT_S, check_s=check_s, dead_after_s=DEAD_AFTER_S)
    failure = plan["failure"] if rank == world_size - 1 else None
    pauses = random.Random(plan["seed"] * 64 + rank)
    out = Path(out_dir) / f"rank{rank}.json"
    result: dict = {}
    try:
        for round_ in range(plan["rounds"]):
            guard.where = f"round {round_}"
            if failure is not None and round_ == FAIL_ROUND:
                result["failed_at"] = time.time()
                out.write_text(json.dumps(result))
                if failure == "raise":
                    raise ValueError("planted")
                os.kill(os.getpid(), signal.SIGKILL if failure == "kill" else signal.SIGSTOP)
            time.sleep(pauses.uniform(0, 3 * check_s))
            gathered = all_gather(torch.tensor([round_]), None, guard, "soak all-gather")
            if gathered.flatten().tolist() != [round_] * world_size:
                raise AssertionError(f"round {round_} gathered {gathered.flatten().tolist()}")
        result["rounds"] = plan["rounds"]
    except Exception as error:
        if failure == "raise":  # what a rollout's rank does (models/parallel.py)
            guard.post(f"raised at {guard.where}: {type(error).__name__}: {error}")
        else:
            result["raised_at"] = time.time()
            result["error"] = f"{type(error).__name__}: {error}"
    result["timed_out_slices"] = timed_out
    out.write_text(json.dumps(result))
    ranks.leave_together(rank, alive=world_size - (plan["failure"] in ("kill", "stop")))


def run_world(world_size: int, plan: dict) -> dict:
    """Start one world, wait for it, and judge it: ``{"verdict": "ok" | why not, ...}``."""
    with tempfile.TemporaryDirectory(prefix="soak_fail_fast_") as out_dir:
        failed = world_size - 1 if plan["failure"] else None
        frozen = (failed,) if plan["failure"] == "stop" else ()
        with pytest.MonkeyPatch.context() as monkeypatch:
            processes = ranks.start(run, world_size, (out_dir, plan), monkeypatch)
            started = time.monotonic()
            codes = ranks.wait(processes, WORLD_DEADLINE_S, frozen=frozen)
        seconds = time.monotonic() - started
        results = {}
        for rank in range(world_size):
            path = Path(out_dir) / f"rank{rank}.json"
            results[rank] = json.loads(path.read_text()) if path.is_file() else {}
    verdict = "ok"
    waiting = [rank for rank in range(world_size) if rank != failed]
    hung = [rank for rank in waiting if codes[rank] != 0]
    if hung:
        verdict = f"ranks {hung} did not exit cleanly ({codes})"
    elif failed is None:
        errors = {r: results[r].get("error") for r in waiting if "rounds" not in results[r]}
        if errors:
            verdict = f"false failure: {errors}"
    else:
        failed_at = results[failed].get("failed_at")
        late = {
            rank: results[rank].get("error", "no error")
            for rank in waiting
            if failed_at is None
            or "raised_at" not in results[rank]
            or not results[rank]["error"].startswith("RankFailedError")
            or results[rank]["raised_at"] - failed_at >= CAUGHT_WITHIN_S
        }
        if late:
            verdict = f"not caught within {CAUGHT_WITHIN_S:g} s: {late}"
    caught = [
        results[rank]["raised_at"] - results[failed]["failed_at"]
        for rank in waiting
        if failed is not None and "raised_at" in results[rank] and "failed_at" in results[failed]
    ]
    return {
        "verdict": verdict,
        "seconds": seconds,
        "timed_out_slices": sum(results[r].get("timed_out_slices", 0) for r in waiting),
        "caught_s": max(caught, default=None),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.models.soak_fail_fast", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--worlds", type=int, default=30, help="healthy worlds (2, 4 ranks)")
    parser.add_argument("--planted", type=int, default=6, help="worlds with a planted failure")
    parser.add_argument("--rounds", type=int, default=150, help="all-gathers per healthy rank")
    parser.add_argument("--check-s", type=float, default=0.01, help="the guard's wait slice")
    parser.add_argument(
        "--stress", type=int, default=os.cpu_count() or 1, help="busy processes loading the CPU"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("worlds", "planted", "rounds", "stress"):
        if getattr(args, name) < 0:
            parser.error(f"--{name} must be >= 0")
    if args.rounds <= FAIL_ROUND or args.check_s <= 0:
        parser.error(f"--rounds must exceed {FAIL_ROUND} and --check-s be positive")

    stress = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.stress)
    ]
    started = time.monotonic()
    false_failures, missed, slices, caught = 0, 0, 0, []
    try:
        worlds = [(None, 2 + 2 * (i % 2)) for i in range(args.worlds)]
        # kinds and sizes in turn: 6 planted worlds hold every kind at 2 and at 4 ranks
        worlds += [(FAILURES[i % 3], 2 + 2 * (i % 2)) for i in range(args.planted)]
        for index, (failure, world_size) in enumerate(worlds):
            plan = {
                "failure": failure,
                "rounds": args.rounds,
                "check_s": args.check_s,
                "seed": args.seed * 1000 + index,
            }
            judged = run_world(world_size, plan)
            if judged["verdict"] != "ok":
                missed += failure is not None
                false_failures += failure is None
            slices += judged["timed_out_slices"]
            if judged["caught_s"] is not None:
                caught.append(judged["caught_s"])
            what = f"planted {failure}" if failure else "healthy"
            tail = f", caught in {judged['caught_s']:.2f} s" if judged["caught_s"] else ""
            print(
                f"world {index + 1}/{len(worlds)}: {world_size} ranks, {what}, "
                f"{judged['seconds']:.1f} s, {judged['timed_out_slices']} slices timed out"
                f"{tail}: {judged['verdict']}",
                flush=True,
            )
    finally:
        for process in stress:
            process.kill()
            process.wait()
    print(
        f"soak_fail_fast: {time.monotonic() - started:.0f} s, {args.stress} stress processes: "
        f"{false_failures} false failures in {args.worlds} healthy worlds "
        f"({slices} wait slices timed out); {args.planted - missed} of {args.planted} planted "
        f"failures caught within {CAUGHT_WITHIN_S:g} s (slowest {max(caught, default=0):.2f} s)"
    )
    return 1 if false_failures or missed else 0


if __name__ == "__main__":
    sys.exit(main())
