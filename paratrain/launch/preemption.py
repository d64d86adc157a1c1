"""Stopping for a requeue: SIGTERM or SIGUSR1 to any rank, or to the launcher (which passes it on),
makes every rank stop at the same step boundary, save a checkpoint and exit ``EXIT_REQUEUE``.

Signals reach ranks at different moments, so no rank acts alone. At every step boundary each rank
adds the signal it has received (0 for none) to a MAX all-reduce of one int, and reads the result of
the previous boundary's reduction: all ranks stop one boundary after any of them reported a signal.
Reading one boundary late keeps the host from waiting for the device (on CUDA the result is copied to
pinned memory behind an event, long complete by the next boundary), so a step never stalls on it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

from paratrain.errors import Preempted
from paratrain.launch.process_group import DistContext
from paratrain.parallel.collectives import barrier, is_distributed

logger = logging.getLogger("paratrain")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# paratrain's launcher sets this to its pid. A worker group that stopped on purpose tells the launcher
# with STOPPED_NOTICE before any worker exits, so torchrun does not count the exits as a failure to
# restart from (--max-restarts).
LAUNCHER_PID_ENV = "PARATRAIN_LAUNCHER_PID"
STOPPED_NOTICE = signal.SIGUSR2
# The StopSignals catching this process's stop signals, if one is: signal handlers are per process too.
_installed: list[StopSignals] = []


class StopSignals:
    """Catches STOP_SIGNALS in this process and lets all ranks agree when to act on them.

    Args:
        device: This rank's device; the all-reduce runs there (NCCL wants CUDA tensors).
    """

    def __init__(self, device: torch.device):
        self.received = 0  # the last stop signal this process got, 0 for none
        self._previous_handlers: dict[int, object] = {}
        self._flag = torch.zeros(1, dtype=torch.int32, device=device)
        on_cuda = device.type == "cuda"
        self._result = torch.zeros(1, dtype=torch.int32, pin_memory=True) if on_cuda else self._flag
        self._reduced = torch.cuda.Event() if on_cuda else None
        self._pending = False

    @classmethod
    def install(cls, device: torch.device) -> StopSignals:
        """Starts catching; signals can only be caught from the main thread, elsewhere none are."""
        watcher = cls(device)
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                watcher._previous_handlers[signum] = signal.signal(signum, watcher._on_signal)
            _installed[:] = [watcher]
        else:
            logger.warning("training outside the main thread: SIGTERM/SIGUSR1 will not stop it at a step boundary")
        return watcher

    @property
    def received_name(self) -> str | None:
        return signal.Signals(self.received).name if self.received else None

    def uninstall(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()
        if self in _installed:
            _installed.clear()

    def agreed_signal(self) -> signal.Signals | None:
        """The stop signal every rank acts on now, or None. A collective: every rank calls it at
        every step boundary and gets the same answer."""
        agreed = self._read_previous_reduction()
        self._flag.fill_(self.received)
        if is_distributed():
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        if self._reduced is not None:
            self._result.copy_(self._flag, non_blocking=True)
            self._reduced.record()
        self._pending = True
        return agreed

    def agreed_so_far(self) -> signal.Signals | None:
        """The signal the last boundary's reduction agreed on (alike on every rank), starting no other: the next
        boundary's ``agreed_signal`` returns the same."""
        return self._read_previous_reduction()

    def _read_previous_reduction(self) -> signal.Signals | None:
        if not self._pending:
            return None
        if self._reduced is not None:
            self._reduced.synchronize()
        value = int(self._result.item())
        return signal.Signals(value) if value else None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a store: logging here could deadlock on a lock the interrupted code holds.
        self.received = signum


def received_stop_signal() -> str | None:
    """The stop signal this process has received (e.g. ``SIGTERM``), or None: for code waiting outside the step
    loop (a replica group asking for a quorum), which no step boundary will come to stop."""
    return _installed[0].received_name if _installed else None


def stop_vote(device: torch.device) -> torch.Tensor:
    """This group's vote to stop, for the step's cross-group all-reduce (``launch/replica_groups.py``): one-hot over
    STOP_SIGNALS, the signal its ranks agreed on at the last boundary (alike on each of them), zeros for none.
    Replica groups receive a signal at different moments; a group that stopped a step before another would resume
    behind it and heal past the step the other took alone, a step it never trains or logs."""
    vote = torch.zeros(len(STOP_SIGNALS), device=device)
    agreed = _installed[0].agreed_so_far() if _installed else None
    if agreed is not None:
        vote[STOP_SIGNALS.index(agreed)] = 1.0
    return vote


def voted_stop(votes: list[float]) -> signal.Signals | None:
    """The stop signal every replica group acts on at this boundary: the first of STOP_SIGNALS any group voted for
    in the step's all-reduce (``stop_vote``), or None."""
    return next((signum for signum, count in zip(STOP_SIGNALS, votes, strict=True) if count > 0), None)


def announce_stop(*, local_rank: int) -> None:
    """Tells paratrain's launcher, when it started this process, that the group stopped on purpose;
    returns once every rank has, so no worker exits before every launcher knows."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if local_rank == 0 and launcher is not None and _started_by(int(launcher)):
        os.kill(int(launcher), STOPPED_NOTICE)
    barrier()


def _started_by(launcher: int) -> bool:
    """Whether ``launcher`` started this process: its parent, or its fork server's parent
    (``paratrain.launch.forked_workers``). A variable inherited from elsewhere names another process."""
    parent = os.getppid()
    return launcher in (parent, _parent_of(parent))


def _parent_of(pid: int) -> int | None:
    try:  # /proc/PID/stat: "PID (COMMAND) STATE PPID ...", the command may hold spaces and parentheses
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def end_on_signal(
    signal_name: str, checkpoint: Path, *, step: int, ctx: DistContext, received: str | None
) -> Preempted:
    """Says that every rank agreed to stop after ``step`` on ``signal_name`` (``checkpoint`` is complete),
    tells the launcher, and returns the exception the run ends with. ``received``: the signal this rank
    itself received, if any."""
    if received:
        logger.warning("rank %d received %s", ctx.rank, received)
    logger.info("stopping at step %d on %s: checkpoint %s is complete", step, signal_name, checkpoint)
    stopped = Preempted(step=step, checkpoint=checkpoint, signal_name=signal_name)
    # Said before announcing: once the launcher knows, it may stop this process with the group, and
    # a message left for after the exception had reached the caller was lost in about 1 run in 6.
    logger.info("%s", stopped)
    announce_stop(local_rank=ctx.local_rank)
    return stopped
