"""Ending a replica group's rank that a stop signal finds stuck in its group's commit vote or quorum request.

torchrun stops a group one of whose ranks died by sending SIGTERM to the others. A survivor inside torchft's
commit vote (``manager.should_commit``: Rust, the GIL released) runs no Python signal handler until the vote
times out (``timeout_s``), since the dead rank never votes. If that survivor is the group's rank 0, its
manager server keeps heartbeating all that time, so the lighthouse holds the next quorum for the group and
every live group waits (about 6 s per such kill in the chaos benchmark, with ``timeout_s`` 5 s).

Python's C-level signal handler still writes the signal's number to the wakeup fd (``signal.set_wakeup_fd``)
at once, so a thread reading that fd learns of the stop while the main thread is blocked. The watch ends the
process with EXIT_GROUP_RESTART once the vote is still open GRACE_S after both the stop signal and the vote's
start, or at once where a rank of the group on this host is gone (exited, or a zombie nobody reaped yet): torchrun
is restarting the group anyway, and the group heals from a live peer. The grace is for ranks on other hosts, whose
processes this one cannot see; waiting it out cost about a second a kill where one rank of the group was.

A job-wide stop (a preemption, where every group must save a checkpoint) does not meet the grace: every rank
of the group is alive and comes to the vote straight from the cross-group all-reduce, which each leaves once
the slowest group is done, so the vote closes within milliseconds and the ranks stop at the step boundary
and save, as before.

The quorum request blocks the same way where a rank of the group died between two steps: the group's rank 0
hosts its torchft manager server, which forwards the group's request to the lighthouse once every rank of the
group asked, so the survivors wait for the dead rank until ``quorum_timeout_s`` (120 s by default), and torchrun
ended them by force only 30 s after its SIGTERM while every live group waited (a 30.6 s pause in the chaos
benchmark). There only a rank of the group gone from this host ends the process: a quorum may rightly stay open
longer than any grace (a group restarting, the run's first step waiting for every group), and a preempted rank
inside it must go on to save.
"""

from __future__ import annotations

import atexit
import os
import select
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from paratrain.errors import EXIT_GROUP_RESTART

# How long a vote may stay open after a stop signal: far above the vote of live ranks (milliseconds), far
# below the vote's timeout that it cuts short.
GRACE_S = 1.0
# How often the watching thread looks at the clock while nothing arrives on the wakeup fd.
POLL_S = 0.1
# What the stop signals are (launch/preemption.py catches the same): any other signal does not count.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGUSR1})


class StuckVoteWatch:
    """Watches this process's stop signals from a thread of its own and ends the process when one finds
    the main thread in a vote (``with watch.voting():``) that stays open ``grace_s`` longer.

    Args:
        grace_s: How long the vote may stay open after both the signal and its start.
        siblings: The process ids of the group's other ranks on this host.
    """

    def __init__(self, grace_s: float = GRACE_S, siblings: tuple[int, ...] = ()):
        self.grace_s = grace_s
        self.siblings = siblings
        self._stopped_at: float | None = None
        self._vote_started_at: float | None = None
        self._where, self._graced = "its group's commit vote", True  # the blocking call the main thread is in
        self._read_fd, self._write_fd = os.pipe()
        for fd in (self._read_fd, self._write_fd):
            os.set_blocking(fd, False)  # set_wakeup_fd wants it; the thread reads only what select found
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="paratrain-stuck-vote", daemon=True)
        self._thread.start()
        # Stopped before the interpreter finalizes: a daemon thread taking the GIL back then is ended by force.
        atexit.register(self.close)

    @classmethod
    def start(cls, grace_s: float = GRACE_S, siblings: tuple[int, ...] = ()) -> StuckVoteWatch | None:
        """The watch, or None outside the main thread (where no signal can be caught, nor the wakeup fd set)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        return cls(grace_s, siblings)

    @contextmanager
    def voting(self) -> Iterator[None]:
        """Marks the main thread as inside the commit vote for as long as the block runs."""
        with self._inside("its group's commit vote", graced=True):
            yield

    @contextmanager
    def asking_for_quorum(self) -> Iterator[None]:
        """Marks the main thread as inside the quorum request for as long as the block runs: only a rank of the
        group gone from this host ends it (no grace)."""
        with self._inside("its group's quorum request", graced=False):
            yield

    @contextmanager
    def _inside(self, where: str, *, graced: bool) -> Iterator[None]:
        self._where, self._graced = where, graced
        self._vote_started_at = time.monotonic()
        try:
            yield
        finally:
            self._vote_started_at = None

    def close(self) -> None:
        """Stops the thread and gives the wakeup fd back; called at exit, and safe to call twice."""
        if self._done.is_set():
            return
        self._done.set()
        self._thread.join(timeout=1.0 + POLL_S)
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        for fd in (self._read_fd, self._write_fd):
            os.close(fd)

    def _watch(self) -> None:
        while not self._done.is_set():
            readable, _, _ = select.select([self._read_fd], [], [], POLL_S)
            stopped_now = readable and any(number in STOP_SIGNALS for number in os.read(self._read_fd, 64))
            if stopped_now and self._stopped_at is None:
                self._stopped_at = time.monotonic()
            why = self._why_the_vote_is_stuck()
            if why is not None:
                _end_process(self._where, why)

    def _why_the_vote_is_stuck(self) -> str | None:
        started, stopped = self._vote_started_at, self._stopped_at
        if started is None or stopped is None:
            return None
        gone = [pid for pid in self.siblings if process_is_gone(pid)]
        if gone:
            return f"the group's rank in process {gone[0]} is gone"
        if self._graced and time.monotonic() - max(started, stopped) > self.grace_s:
            return f"still open {self.grace_s:g} s later (a rank of the group is gone)"
        return None


def group_ranks_on_this_host() -> tuple[int, ...]:
    """The process ids of this group's other ranks that run on this host, in this process id namespace (the
    group's process group gathers every rank's; a one-process group has none)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ()
    ranks: list[tuple[str, int] | None] = [None] * dist.get_world_size()
    here = _host_and_pid_namespace()
    dist.all_gather_object(ranks, (here, os.getpid()))
    return tuple(pid for host, pid in ranks if host == here and pid != os.getpid())


def _host_and_pid_namespace() -> str:
    # The boot id tells hosts apart where names repeat; the namespace, containers whose process ids collide.
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot_id:
            return f"{boot_id.read().strip()} {os.readlink('/proc/self/ns/pid')}"
    except OSError:  # no /proc: no rank is known to share this host, and the grace decides
        return f"pid {os.getpid()}"


def process_is_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited: no longer in /proc, or a zombie (or dead) awaiting its parent's wait."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read()
    except FileNotFoundError:
        return True
    except OSError:  # no /proc to read: the grace decides
        return False
    state = fields.rpartition(")")[2].split()[0]  # after the command name, which may hold spaces and parentheses
    return state in ("Z", "X", "x")


def _end_process(where: str, why: str) -> None:
    # os.write, not logging: the main thread may hold the logging lock, and no exit hook may wait on it.
    message = (
        f"paratrain: a stop signal found this rank in {where}, {why}: exiting "
        f"{EXIT_GROUP_RESTART} so that the group restarts and heals\n"
    )
    os.write(2, message.encode())
    os._exit(EXIT_GROUP_RESTART)
