"""Hang diagnosis: a watchdog thread per rank that ends a step which takes longer than
``debug.step_timeout_s`` instead of letting the job hang.

When it fires, each rank writes ``output_dir/hang/rank<R>.txt``: a first line saying where its training
thread is (the collective it waits in, when its stack shows one) and then every thread's Python stack
(faulthandler). In lockstep training every rank stops at the same step, so every watchdog fires
within about one step of the others. Rank 0 waits briefly for the other ranks' reports (the output
directory is the shared storage checkpoints already need), prints one line per rank and writes them
to ``hang/summary.txt``; every rank then exits ``EXIT_HANG``. A rank whose report never came is named
as such: it died, or its interpreter is stuck too hard for a thread to run.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from types import FrameType

from paratrain.errors import EXIT_HANG

logger = logging.getLogger("paratrain")

REPORT_GRACE_S = 10.0  # how long rank 0 waits for the other ranks' reports, and they for its summary
_COLLECTIVES_FILE = "distributed_c10d.py"
_BACKWARD_FUNCTION = "_engine_run_backward"  # DDP's and FSDP's gradient collectives wait in here


class StepWatchdog:
    """Arms at construction; ``step_done`` rearms it. Does nothing when ``timeout_s`` is None.

    Args:
        timeout_s: Longest a step may take (from the end of the previous one, its checkpoint and
            logging included), or None for no watchdog.
        directory: Where the reports go (``output_dir/hang``).
        rank: This process's global rank; rank 0 summarises.
        world_size: Ranks whose reports rank 0 waits for.
    """

    def __init__(self, timeout_s: float | None, *, directory: Path, rank: int, world_size: int):
        self.timeout_s, self.directory, self.rank, self.world_size = timeout_s, directory, rank, world_size
        self._training_thread_id = threading.get_ident()
        self._started = time.time()
        self._last_done = time.monotonic()
        self._step = 0
        self._stopped = threading.Event()
        if timeout_s is not None:
            threading.Thread(target=self._watch, name="paratrain-watchdog", daemon=True).start()

    def step_done(self, step: int) -> None:
        self._step, self._last_done = step, time.monotonic()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        assert self.timeout_s is not None
        while not self._stopped.wait(min(1.0, self.timeout_s / 4)):
            waited = time.monotonic() - self._last_done
            if waited > self.timeout_s:
                self._report_and_exit(step=self._step + 1, waited=waited)

    def _report_and_exit(self, *, step: int, waited: float) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        where = describe_wait(sys._current_frames().get(self._training_thread_id))
        line = f"rank {self.rank}: step {step} running for {waited:.1f} s, {where}"
        report = self.directory / f"rank{self.rank}.txt"
        tmp = report.with_suffix(".tmp")
        with open(tmp, "w") as handle:
            handle.write(line + "\n\n")
            handle.flush()
            faulthandler.dump_traceback(handle, all_threads=True)
        os.replace(tmp, report)  # rank 0 never reads half a report
        logger.error("step %d exceeded debug.step_timeout_s=%s; stacks in %s", step, self.timeout_s, report)
        if self.rank == 0:
            self._summarise()
        else:
            self._wait_for(lambda: self._fresh(self.directory / "summary.txt"))
        logging.shutdown()
        os._exit(EXIT_HANG)

    def _summarise(self) -> None:
        reports = [self.directory / f"rank{rank}.txt" for rank in range(self.world_size)]
        self._wait_for(lambda: all(self._fresh(path) for path in reports))
        lines = [
            path.read_text().splitlines()[0]
            if self._fresh(path)
            else f"rank {rank}: no report (the process died, or no thread of it can run)"
            for rank, path in enumerate(reports)
        ]
        summary = "\n".join(lines)
        (self.directory / "summary.txt").write_text(summary + "\n")
        logger.error("hang: where each rank is (full stacks in %s):\n%s", self.directory, summary)

    def _fresh(self, path: Path) -> bool:
        """Written by this attempt, not left by an earlier one in the same output_dir."""
        return path.is_file() and path.stat().st_mtime >= self._started - 1.0

    @staticmethod
    def _wait_for(condition) -> None:
        deadline = time.monotonic() + REPORT_GRACE_S
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.1)


def describe_wait(frame: FrameType | None) -> str:
    """Where a thread is, innermost first: the torch.distributed collective it waits in, a backward
    (where DDP and FSDP run their gradient collectives), or else its innermost frame."""
    if frame is None:
        return "training thread not found"
    stack = traceback.extract_stack(frame)
    for index in range(len(stack) - 1, -1, -1):
        entry = stack[index]
        if entry.filename.endswith(_COLLECTIVES_FILE) or entry.name == _BACKWARD_FUNCTION:
            what = (
                f"collective {entry.name}"
                if entry.filename.endswith(_COLLECTIVES_FILE)
                else "backward (gradient collectives)"
            )
            caller = next((e for e in reversed(stack[:index]) if f"{os.sep}torch{os.sep}" not in e.filename), None)
            called_from = f", called from {caller.filename}:{caller.lineno} ({caller.name})" if caller else ""
            return f"waiting in {what}{called_from}"
    innermost = stack[-1]
    return f"not in a collective: {innermost.name} at {innermost.filename}:{innermost.lineno}"
