"""Spawning ranks for the multi-process tests: gloo on 127.0.0.1, hard deadlines.

``start`` launches ``world_size`` processes of ``target(rank, port, world_size, *args)`` with
``torch.multiprocessing`` (spawn) and ``wait`` waits for them until a deadline, without the
all-or-nothing ``join`` of ``torch.multiprocessing.spawn`` (which kills every rank as soon as
one exits badly: these tests kill or stop a rank on purpose and watch what the others do).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import torch.multiprocessing as mp

# Set in each rank before torch or triton load: one thread per rank (2 shared cores), the
# Triton interpreter, gloo on the loopback interface.
RANK_ENV = {
    "TRITON_INTERPRET": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(target, world_size: int, args: tuple, monkeypatch, **env: str) -> list:
    """The started processes of ``target(rank, port, world_size, *args)``, rank order, with
    ``RANK_ENV`` and ``env`` in their environment."""
    for name, value in {**RANK_ENV, **env}.items():
        monkeypatch.setenv(name, value)
    if sys.platform.startswith("linux"):
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    context = mp.get_context("spawn")
    port = free_port()
    processes = [
        context.Process(target=target, args=(rank, port, world_size, *args), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    return processes


def wait(processes: list, deadline_s: float, *, frozen: tuple[int, ...] = ()) -> list[int | None]:
    """Wait until every process but the ``frozen`` ranks (stopped on purpose) exits or
    ``deadline_s`` passes; kill the rest. Returns each exit code (None: still running)."""
    deadline = time.monotonic() + deadline_s
    awaited = [p for rank, p in enumerate(processes) if rank not in frozen]
    try:
        while any(p.is_alive() for p in awaited) and time.monotonic() < deadline:
            time.sleep(0.2)
        return [None if p.is_alive() else p.exitcode for p in processes]
    finally:
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGCONT)  # a stopped process cannot die otherwise
                process.kill()
                process.join(5)


def leave_together(rank: int, alive: int, timeout_s: float = 30.0) -> None:
    """In a rank: wait until ``alive`` ranks have called this, then exit (``os._exit(0)``),
    rank 0 last: it hosts the store, and a rank still talking to it would fail.

    A rank that raised therefore stays alive (its connections open, as in a real job) until the
    others have raised: only its posted error can have told them.
    """
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    deadline = time.monotonic() + timeout_s

    def wait_for(key: str, count: int) -> None:
        while store.add(key, 0) < count and time.monotonic() < deadline:
            time.sleep(0.05)

    store.add("arrived", 1)
    wait_for("arrived", alive)
    if rank == 0:
        wait_for("left", alive - 1)
    else:
        store.add("left", 1)
    os._exit(0)
