"""An in-process multi-rank harness: N gloo ranks kept alive for the whole test session, each running
whatever function a test sends it and returning its result.

Why real processes over gloo and not torch's threaded process group
(``torch.testing._internal.distributed.multi_threaded_pg``): the threaded group is a private test
backend that fakes collectives in Python between threads of one process; it shares the default
group, the RNG and DTensor's global state between "ranks", and it is not what training runs on. Here
every rank is its own process with its own ``torch.distributed`` default group over gloo (the CPU
backend paratrain trains on), so DeviceMesh, DTensor redistribution and FSDP2's reduce-scatter run
the same code they run under torchrun. Start-up (spawning N interpreters that import torch) is paid
once per session; after that a test costs its own work plus a queue round trip.

Functions sent to the ranks must be importable module-level functions (they are pickled by name) and
return picklable values. A rank that raises sends its traceback back; the pool is then closed (its
other ranks may be stuck in a collective) and the next ``pool`` request starts a fresh one.
"""

from __future__ import annotations

import os
import queue
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.harness import free_loopback_port

RESULT_TIMEOUT_S = 120  # start-up on a loaded 2-core machine included
COLLECTIVE_TIMEOUT_S = 60  # a rank waiting on a partner that raised gives up after this


class RankFailure(AssertionError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


class RankPool:
    """``world_size`` gloo ranks; ``run(fn, *args)`` calls ``fn(*args)`` on every rank and returns the
    results in rank order."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        context = mp.get_context("spawn")
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(world_size)]
        init_method = f"tcp://127.0.0.1:{free_loopback_port()}"
        self._processes = [
            context.Process(target=_serve, args=(rank, world_size, init_method, self._tasks[rank], self._results))
            for rank in range(world_size)
        ]
        for process in self._processes:
            process.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Runs ``fn(*args)`` on every rank at once; raises RankFailure naming each rank that raised."""
        for tasks in self._tasks:
            tasks.put((fn, args))
        outcomes = {}
        try:
            while len(outcomes) < self.world_size:
                rank, ok, value = self._results.get(timeout=RESULT_TIMEOUT_S)
                outcomes[rank] = (ok, value)
        except queue.Empty as timeout:
            self.close()
            raise RankFailure(
                f"{fn.__name__}: ranks {sorted(set(range(self.world_size)) - outcomes.keys())} sent nothing"
            ) from timeout
        failures = [f"rank {rank}:\n{value}" for rank, (ok, value) in sorted(outcomes.items()) if not ok]
        if failures:
            self.close()
            raise RankFailure(f"{fn.__name__} raised\n" + "\n".join(failures))
        return [outcomes[rank][1] for rank in range(self.world_size)]

    def close(self) -> None:
        self.broken = True
        for tasks in self._tasks:
            tasks.put(None)
        for process in self._processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()


def _serve(rank: int, world_size: int, init_method: str, tasks, results) -> None:
    """A rank's loop: join the gloo group once, then run tasks until told to stop (None)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    # No destroy_process_group at the end: the process exits, and a partner that broke could block it.
    while (task := tasks.get()) is not None:
        fn, args = task
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test, with its traceback
            results.put((rank, False, traceback.format_exc()))
