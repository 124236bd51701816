"""Ranks that fail together: a failure flag and heartbeats on the rendezvous store.

A rank of a parallel rollout that raises, or dies, would otherwise leave every other rank
blocked in its next collective until the process group's timeout (30 minutes by default for
gloo). ``FailFast`` is a side channel beside the collectives, on the store the ranks met on
(``torchrun``'s, or ``init_process_group``'s ``tcp://`` / ``env://`` one):

* **the flag**: a rank that fails writes one line (who failed, where, why) under a world-wide
  key; the first line written stays. Once set the world is poisoned: every later guarded wait on
  every rank raises ``RankFailedError`` with that line. Destroy the process group and start over
  (``torchrun --max-restarts`` does that): the collectives' order is broken for good.
* **heartbeats**: a daemon thread per process adds 1 to its rank's counter every
  ``heartbeat_s``. A waiting rank reads the others' counters 8 times per ``dead_after_s``; one
  that has not moved for ``dead_after_s`` is a rank that was killed or stopped (``SIGKILL``,
  ``SIGSTOP``, a machine lost), and the waiting rank sets the flag naming it.
* **guarded waits**: the rollout's collectives are issued with ``async_op=True`` and handed to
  ``wait``, which waits for them ``check_s`` at a time (gloo: a blocking wait that ends the
  moment the collective does, so a healthy wait costs nothing) and between waits looks at the
  flag and the heartbeats. A collective that fails (gloo reports a peer's closed connection at
  once) sets the flag too; a slice that times out as its collective completes does not (the
  completed work's own outcome decides). A rank blocked in a collective therefore raises
  within ``check_s`` of the flag being set.

Why a side channel rather than short collective timeouts: a healthy peer may legitimately be
minutes late (a long first forward, compilation), so no collective timeout tells slow from dead;
the heartbeats do, and the flag carries the failing rank's own error to everyone.

On CUDA tensors (NCCL) waiting for the host would stall the launch queue at every collective, so
``wait`` only orders the current stream after the collective (``Work.wait()``); a hang is seen at
the next wait that needs the result on the host (``host=True``: the per-forward plan digest),
which polls ``Work.is_completed()``. The CPU path (gloo) is what the tests run; the NCCL path is
the same code, not measured here.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref
from datetime import timedelta
from typing import ClassVar

import torch.distributed as dist

ABORT_KEY = "paged_video/fail_fast/abort"
HEARTBEAT_KEY = "paged_video/fail_fast/alive/"


class RankFailedError(RuntimeError):
    """Another rank of the world failed or stopped (or the world was already poisoned)."""


class FailFast:
    """The failure flag and heartbeats of the current default process group (one per world).

    ``FailFast.for_world()`` returns the one guard of the current world, starting its heartbeat
    thread on first use; every rank must use it (the heartbeats are how the others know it is
    alive). ``where`` is a short description of what the rank is doing (e.g. ``"block 3,
    forward 2"``), put in the messages.
    """

    _current: ClassVar[FailFast | None] = None

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        *,
        heartbeat_s: float = 0.5,
        check_s: float = 0.2,
        dead_after_s: float = 15.0,
    ) -> None:
        for name, value in (
            ("heartbeat_s", heartbeat_s),
            ("check_s", check_s),
            ("dead_after_s", dead_after_s),
        ):
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if dead_after_s < 4 * heartbeat_s:
            raise ValueError(
                f"dead_after_s ({dead_after_s}) must be at least 4 heartbeats ({heartbeat_s} s): "
                "a live rank must never look dead"
            )
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.heartbeat_s = heartbeat_s
        self.check_s = check_s
        self.dead_after_s = dead_after_s
        self.where = "setup"
        # The world this guard belongs to, weakly: a guard must not keep a destroyed world's
        # process group (and its pending collectives) alive until the interpreter exits.
        self._world: weakref.ref | None = None
        # Per peer: the last counter seen and when (this process's monotonic clock) it moved.
        self._seen: dict[int, tuple[int, float]] = {}
        # The peers' counters are read a few times per dead_after_s, not at every check: a
        # large world would otherwise read every rank's counter every check_s.
        self._next_heartbeats = 0.0
        self._stop = threading.Event()
        self._beat()  # the first heartbeat before anyone can wait for it
        self._thread = threading.Thread(
            target=self._heartbeats, name=f"paged_video-heartbeat-{rank}", daemon=True
        )
        self._thread.start()

    @classmethod
    def for_world(cls, **settings: float) -> FailFast:
        """The guard of the current default process group, made (and started) on first use.

        ``settings`` (``heartbeat_s``, ``check_s``, ``dead_after_s``) apply when it is made;
        later calls with other settings raise, as every part of the world must use one guard.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("FailFast needs torch.distributed.init_process_group first")
        world = dist.group.WORLD
        current = cls._current
        if current is not None and current._world is not None and current._world() is world:
            wanted = {name: getattr(current, name) for name in settings}
            if settings and wanted != settings:
                raise ValueError(
                    f"this world's FailFast already runs with {wanted}; got {settings}"
                )
            return current
        if current is not None:
            current.close()  # a world destroyed and made again: its guard goes with it
        guard = cls(
            dist.distributed_c10d._get_default_store(),
            dist.get_rank(),
            dist.get_world_size(),
            **settings,
        )
        guard._world = weakref.ref(world)
        cls._current = guard
        return guard

    @classmethod
    def _close_current(cls) -> None:
        if cls._current is not None:
            cls._current.close()

    def close(self) -> None:
        """Stop the heartbeats (the others will take this rank for dead if they still wait).

        Waits for the heartbeat thread to leave the store: a daemon thread still inside a store
        call while the interpreter exits and destroys that store aborts the process
        (``terminate called without an active exception``).
        """
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10 * self.heartbeat_s)

    def _beat(self) -> None:
        self.store.add(f"{HEARTBEAT_KEY}{self.rank}", 1)

    def _heartbeats(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            if self._world is not None and self._world() is None:
                return  # the world was destroyed
            try:
                self._beat()
            except Exception:  # the store is gone (the world was torn down): nothing to tell
                return

    def post(self, message: str) -> None:
        """Set the flag to ``message`` unless a failure was posted first; never raises (the
        store may be what failed)."""
        with contextlib.suppress(Exception):
            self.store.compare_set(ABORT_KEY, "", f"rank {self.rank}: {message}")

    def posted(self) -> str | None:
        """The flag's line, or None while no rank has failed."""
        if not self.store.check([ABORT_KEY]):
            return None
        return self.store.get(ABORT_KEY).decode(errors="replace")

    def check(self, what: str) -> None:
        """Raise ``RankFailedError`` if the flag is set or a peer's heartbeat stopped."""
        try:
            line = self.posted()
            if line is None and time.monotonic() >= self._next_heartbeats:
                self._next_heartbeats = time.monotonic() + self.dead_after_s / 8
                line = self._dead_peers()
        except RankFailedError:
            raise
        except Exception as error:  # the store itself is unreachable
            raise RankFailedError(
                f"rank {self.rank} at {self.where} ({what}): the rendezvous store is unreachable "
                f"({type(error).__name__}: {error}); the rank hosting it may have died"
            ) from error
        if line is not None:
            raise RankFailedError(f"{line} (rank {self.rank} stopped at {self.where}, {what})")

    def _dead_peers(self) -> str | None:
        """Post and return a line naming the peers whose heartbeat has not moved for
        ``dead_after_s``; None when every peer is alive."""
        now = time.monotonic()
        dead = []
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            count = self.store.add(f"{HEARTBEAT_KEY}{peer}", 0)
            last = self._seen.get(peer)
            if last is None or last[0] != count:
                self._seen[peer] = (count, now)
            elif now - last[1] > self.dead_after_s:
                dead.append(peer)
        if not dead:
            return None
        self.post(
            f"saw no heartbeat from ranks {dead} for {self.dead_after_s:g} s (killed or stopped) "
            f"while at {self.where}"
        )
        return self.posted()

    def wait(self, work: dist.Work, what: str, *, cuda: bool = False, host: bool = True) -> None:
        """Wait for ``work`` (issued with ``async_op=True``) while watching the flag and the
        heartbeats; ``RankFailedError`` when a rank failed or the collective did.

        CPU tensors (gloo): blocking waits of ``check_s`` each, so the wait ends the moment the
        collective does. CUDA tensors (``cuda``): with ``host=False`` only order the current
        stream after the collective; with ``host`` poll ``is_completed()`` between short sleeps.
        """
        if cuda and not host:
            work.wait()
            return
        try:
            if cuda:
                self._poll(work, what)
            else:
                timeout = timedelta(seconds=self.check_s)
                while not self._wait_for(work, timeout):
                    self.check(what)
        except RankFailedError:
            raise
        except Exception as error:  # the collective failed, e.g. a peer's connection closed
            # A peer that failed first has posted why: that is the cause to report.
            self.post(f"{what} failed at {self.where}: {type(error).__name__}: {error}")
            self.check(what)
            raise RankFailedError(f"rank {self.rank}: {what} failed at {self.where}") from error

    @staticmethod
    def _wait_for(work: dist.Work, timeout: timedelta) -> bool:
        """Whether ``work`` finished within ``timeout`` (its own failure raises).

        A wait that times out ("Operation timed out!") while the collective completes, after the
        timeout and before the completion check, is no failure: the collective's own outcome
        is what a second wait on the completed work gives (at once: its result, or its error).
        """
        try:
            work.wait(timeout)
        except Exception:
            if not work.is_completed():
                return False  # only the wait's timeout: the collective goes on
            work.wait()  # completed: returns at once, or raises the collective's own failure
        return True

    def _poll(self, work: dist.Work, what: str) -> None:
        pause, next_check = 1e-4, time.monotonic() + self.check_s
        while not work.is_completed():
            if time.monotonic() >= next_check:
                self.check(what)
                next_check = time.monotonic() + self.check_s
            time.sleep(pause)
            pause = min(2 * pause, self.check_s / 4)
        work.wait()


# A rank that returns without closing its guard (or destroys its world first) must not exit with
# the heartbeat thread inside a store call; see ``FailFast.close``.
atexit.register(FailFast._close_current)
