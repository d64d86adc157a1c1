"""Ending a replica group's rank that a stop signal finds stuck in its group's commit vote.

torchrun stops a group one of whose ranks died by sending SIGTERM to the others. A survivor inside torchft's
commit vote (``manager.should_commit``: Rust, the GIL released) runs no Python signal handler until the vote
times out (``timeout_s``), since the dead rank never votes. If that survivor is the group's rank 0, its
manager server keeps heartbeating all that time, so the lighthouse holds the next quorum for the group and
every live group waits (about 6 s per such kill in the chaos benchmark, with ``timeout_s`` 5 s).

Python's C-level signal handler still writes the signal's number to the wakeup fd (``signal.set_wakeup_fd``)
at once, so a thread reading that fd learns of the stop while the main thread is blocked. The watch ends the
process with EXIT_GROUP_RESTART once the vote is still open GRACE_S after both the stop signal and the vote's
start; torchrun is restarting the group anyway, and the group heals from a live peer.

A job-wide stop (a preemption, where every group must save a checkpoint) does not meet the grace: every rank
of the group is alive and comes to the vote straight from the cross-group all-reduce, which each leaves once
the slowest group is done, so the vote closes within milliseconds and the ranks stop at the step boundary
and save, as before.
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
    """

    def __init__(self, grace_s: float = GRACE_S):
        self.grace_s = grace_s
        self._stopped_at: float | None = None
        self._vote_started_at: float | None = None
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
    def start(cls, grace_s: float = GRACE_S) -> StuckVoteWatch | None:
        """The watch, or None outside the main thread (where no signal can be caught, nor the wakeup fd set)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        return cls(grace_s)

    @contextmanager
    def voting(self) -> Iterator[None]:
        """Marks the main thread as inside the vote for as long as the block runs."""
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
            if self._vote_is_stuck():
                _end_process(self.grace_s)

    def _vote_is_stuck(self) -> bool:
        started, stopped = self._vote_started_at, self._stopped_at
        return started is not None and stopped is not None and time.monotonic() - max(started, stopped) > self.grace_s


def _end_process(grace_s: float) -> None:
    # os.write, not logging: the main thread may hold the logging lock, and no exit hook may wait on it.
    message = (
        f"paratrain: a stop signal found this rank in its group's commit vote, still open {grace_s:g} s later "
        f"(a rank of the group is gone): exiting {EXIT_GROUP_RESTART} so that the group restarts and heals\n"
    )
    os.write(2, message.encode())
    os._exit(EXIT_GROUP_RESTART)
