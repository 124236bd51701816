"""``models.fail_fast``: a stopped rank makes every other rank raise within seconds, not at
the collective timeout (here 120 s; gloo's default is 30 min); the flag and the settings.

Three ranks (torch only) run guarded all-gathers; the last one stops itself at round 3 while
the others wait for it. Hard deadline: ``DEADLINE_S``.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from paged_video.models.distributed import all_gather
from paged_video.models.fail_fast import ABORT_KEY, FailFast, RankFailedError
from tests.models import fail_fast_worker, ranks

DEADLINE_S = 60.0
# The heartbeats' verdict: dead_after_s (2 s in the worker) plus polling and a loaded machine.
RAISE_WITHIN_S = 10.0


def test_a_stopped_rank_makes_every_other_rank_raise_within_seconds(tmp_path, monkeypatch):
    # Stopped (SIGSTOP): alive, its connections open, only its heartbeats tell. A rank that
    # raises or is killed is the rollout's case, in tests/models/test_sharded_window.py.
    processes = ranks.start(fail_fast_worker.run, 3, (str(tmp_path),), monkeypatch)
    codes = ranks.wait(processes, DEADLINE_S, frozen=(2,))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for rank in (0, 1):
        assert codes[rank] == 0, f"rank {rank} did not exit cleanly: {codes}"
        error = results[rank]["error"]
        assert error.startswith("RankFailedError: rank "), error
        assert "saw no heartbeat from ranks [2]" in error
        assert results[rank]["raised_at"] - results[2]["failed_at"] < RAISE_WITHIN_S


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_one_guard_per_world_and_a_poisoned_world_raises(world_of_one):
    guard = FailFast.for_world(heartbeat_s=0.1, dead_after_s=1.0)
    assert FailFast.for_world() is guard
    with pytest.raises(ValueError, match="already runs with"):
        FailFast.for_world(dead_after_s=2.0)
    all_gather(torch.ones(2), None, guard, "healthy")  # nothing posted: completes
    assert guard.posted() is None
    guard.post("raised at block 1: ValueError: first")
    guard.post("raised at block 2: ValueError: second")  # the first failure stays
    assert guard.store.get(ABORT_KEY).decode() == "rank 0: raised at block 1: ValueError: first"
    with pytest.raises(RankFailedError, match="rank 0: raised at block 1: ValueError: first"):
        guard.check("the next collective")
    guard.close()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"heartbeat_s": 0}, "heartbeat_s must be a positive"),
        ({"check_s": True}, "check_s must be a positive"),
        ({"heartbeat_s": 1.0, "dead_after_s": 3.0}, "at least 4 heartbeats"),
    ],
)
def test_guard_rejects_bad_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        FailFast(dist.HashStore(), 0, 1, **settings)


class _StubWork:
    """A collective's ``Work`` whose timed waits time out ``timeouts`` times; the last of them
    completes it (with ``error`` when given) between the timeout and the completion check."""

    def __init__(self, timeouts: int, error: Exception | None = None) -> None:
        self.timeouts = timeouts
        self.error = error
        self.completed = False
        self.waits = 0

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits += 1
        if not self.completed and timeout is not None and self.timeouts > 0:
            self.timeouts -= 1
            self.completed = self.timeouts == 0  # the race: done just after the timeout
            raise RuntimeError("Operation timed out!")
        self.completed = True
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.completed


@pytest.mark.parametrize("timeouts", [1, 3])
def test_a_slice_that_times_out_as_the_collective_completes_is_no_failure(timeouts):
    guard = FailFast(dist.HashStore(), 0, 1, heartbeat_s=0.05, check_s=0.01, dead_after_s=1.0)
    try:
        work = _StubWork(timeouts)
        guard.wait(work, "stub all-gather")  # returns: the collective completed
        assert work.completed and guard.posted() is None
    finally:
        guard.close()


@pytest.mark.parametrize("timeouts", [0, 1])
def test_a_collective_that_fails_still_fails_the_world_at_once(timeouts):
    guard = FailFast(dist.HashStore(), 0, 1, heartbeat_s=0.05, check_s=60.0, dead_after_s=1.0)
    try:
        failure = RuntimeError("Connection closed by peer [127.0.0.1]:1234")
        work = _StubWork(timeouts, failure)
        with pytest.raises(RankFailedError, match="stub all-gather failed") as raised:
            guard.wait(work, "stub all-gather")
        # Its own failure, not a slice's timeout, posted for the others; no 60 s slice waited.
        assert "RuntimeError: Connection closed by peer" in str(raised.value)
        assert "Connection closed by peer" in guard.posted() and work.waits <= timeouts + 2
    finally:
        guard.close()


class _SlowStore(dist.HashStore):
    """A store whose heartbeats take a while, as a remote TCPStore's can."""

    def add(self, key: str, value: int) -> int:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)
        return super().add(key, value)


def test_close_returns_only_when_the_heartbeat_thread_left_the_store():
    # A daemon thread still inside a store call when the interpreter exits and destroys the
    # store aborts the process ("terminate called without an active exception").
    guard = FailFast(_SlowStore(), 0, 1, heartbeat_s=0.05, dead_after_s=1.0)
    time.sleep(0.1)  # the thread is inside its first slow heartbeat now
    guard.close()
    assert not guard._thread.is_alive()
