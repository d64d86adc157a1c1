"""Asking torchft for a step's quorum again when it failed: the lighthouse was killed and started again, or
is briefly unreachable. The lighthouse keeps no state a group needs (the quorum is formed anew from the
groups' own steps), so a group that waits for it carries on exactly where it was.

torchft's Manager keeps a failed quorum's error and raises it again from every later ``start_quorum``; its
manager server, though, reaches a restarted lighthouse on the next request (checked with torchft 0.2.0: a
lighthouse killed and restarted 5 s later, both groups stepped on after one failed request). So a failed
request is dropped and asked again, up to ``lighthouse_wait_s`` after the first failure.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from typing import Any

from paratrain.config.schema import FaultToleranceConfig
from paratrain.errors import LighthouseLost, StoppedAwaitingQuorum
from paratrain.launch.lighthouse import lighthouse_host_port
from paratrain.launch.preemption import announce_stop, received_stop_signal
from paratrain.launch.stuck_vote import StuckVoteWatch

logger = logging.getLogger("paratrain")
RETRY_PAUSE_S = 1.0
# How often a retry's pause looks for a stop signal.
STOP_POLL_S = 0.02
# What torchft's quorum request raises when the lighthouse is gone: its RPC's timeout ("Timeout expired"),
# a refused or reset connection.
QUORUM_FAILURES = (TimeoutError, RuntimeError, ConnectionError)


def join_quorum_or_stop(
    manager: Any,
    options: FaultToleranceConfig,
    *,
    group: int,
    local_rank: int,
    watch: StuckVoteWatch | None,
    asked: bool = False,
) -> None:
    """``join_quorum`` at the lighthouse and patience of ``options`` (``parallel.fault_tolerance``), marked for the
    stuck-vote ``watch``; past ``lighthouse_wait_s`` the group stops as a preempted one does (exit code 75), telling
    its launcher."""
    try:
        with watch.asking_for_quorum() if watch is not None else contextlib.nullcontext():
            join_quorum(
                manager,
                lighthouse=options.lighthouse,
                wait_s=options.lighthouse_wait_s,
                group=group,
                step=manager.current_step(),
                asked=asked,
            )
    except LighthouseLost as lost:
        logger.error("%s", lost)  # said before announcing: the launcher may stop this process once it knows
        announce_stop(local_rank=local_rank)
        raise


def join_quorum(manager: Any, *, lighthouse: str, wait_s: float, group: int, step: int, asked: bool = False) -> None:
    """``manager.start_quorum()`` and its wait, asked again while it fails, for up to ``wait_s`` after the first
    failure. ``asked``: the request is already under way (started before the step's own slice, to overlap it);
    only its wait is left.

    Raises:
        StoppedAwaitingQuorum: at a failure, or in the pause before asking again, once this process received a
            stop signal (``launch/preemption.py``): torchrun stopping the group, one of whose ranks died, waits
            for nothing else.
        LighthouseLost: once ``wait_s`` has passed without a quorum, naming the lighthouse and whether it
            answers; the caller's group stops, every step before this one committed.
    """
    first_failure = None
    while True:
        try:
            if not asked:
                manager.start_quorum()
            asked = False
            manager.wait_quorum()
            if first_failure is not None:
                logger.warning(
                    "quorum for step %d formed again after %.0f s", step + 1, time.monotonic() - first_failure
                )
            return
        except QUORUM_FAILURES as error:
            cause, stop = f"{type(error).__name__}: {error}", received_stop_signal()
            if stop is not None:
                raise StoppedAwaitingQuorum(step=step, group=group, signal_name=stop, cause=cause) from error
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            answers = lighthouse_answers(lighthouse)
            if now - first_failure >= wait_s:
                raise LighthouseLost(
                    step=step, group=group, waited_s=now - first_failure, lighthouse=lighthouse, answers=answers,
                    cause=cause,
                ) from error  # fmt: skip
            logger.warning(
                "no quorum for step %d (%s: %s); the lighthouse at %s %s: asking again for up to %.0f s more",
                step + 1, type(error).__name__, error, lighthouse, "answers" if answers else "does not answer",
                wait_s - (now - first_failure),
            )  # fmt: skip
            manager._quorum_future = None  # torchft would raise this failure again from every later request
            stop = pause_unless_stopped(RETRY_PAUSE_S)
            if stop is not None:
                raise StoppedAwaitingQuorum(step=step, group=group, signal_name=stop, cause=cause) from error


def pause_unless_stopped(seconds: float) -> str | None:
    """Sleeps ``seconds``, or until a stop signal arrives; returns the signal's name, or None. A signal handler
    that returns does not cut ``time.sleep`` short, and torchrun stopping a group whose rank died waits for this
    rank: a whole pause cost every live group about a second a kill (a rank whose manager's host died)."""
    deadline = time.monotonic() + seconds
    while (stop := received_stop_signal()) is None and time.monotonic() < deadline:
        time.sleep(min(STOP_POLL_S, max(deadline - time.monotonic(), 0.0)))
    return stop


def lighthouse_answers(address: str) -> bool:
    """Whether the lighthouse accepts a connection now."""
    host, port = lighthouse_host_port(address)
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False
