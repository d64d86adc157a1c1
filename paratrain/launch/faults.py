"""Fault injection for tests and the chaos benchmark: a real SIGKILL at a named point.

``PARATRAIN_FAULT=<point>:<step>[:<rank>]`` kills the process (rank ``rank``, default every rank) when
it reaches ``point`` at ``step``. Points: ``after_step`` (the step and any checkpoint of it are done,
or, for an asynchronous save, started), ``mid_save`` (this rank's checkpoint data is written, the
completion manifest is not), ``mid_async_save`` (an asynchronous save's state is copied and its
background write has begun; training would go on now). ``stall_in_step`` sleeps an hour at the
start of the step instead of killing, for the hang watchdog. ``sigterm_after_step`` sends SIGTERM
instead of SIGKILL, a preemption notice at a known step (a signal sent from outside lands at a step
that depends on how fast the run goes). ``slow_async_save``
delays the background write of an asynchronous save by ``SLOW_WRITE_S`` before it completes, so
that something can happen while a save is in flight. ``nan_grad`` fills this rank's gradients with
NaN after the backward of the step (every rank by default), as a diverging model would. ``slow_step`` sleeps
``SLOW_STEP_S`` at the start of the step, a slow group beside fast ones. ``wait_for_groups`` makes a replica group
wait at the start of the step until every group is back in the quorum (a test's fixed point: a killed
group's restart, however slow the machine, rejoins before the live group can finish). ``mid_heal`` kills a
replica group that has received a live peer's state and not yet applied it (the step is the peer's).
``before_vote`` kills a replica group's rank after the step's cross-group all-reduce, before torchft's commit
vote, so the group's other ranks wait in the vote for it.
``late_manager_on_restart:0`` fires only in a restarted attempt: that rank waits
``LATE_MANAGER_S`` before building its replica group's torchft Manager, so a group's rank 0 comes back
after its peers (the order that once let them read the failed attempt's address).
``fail_first_configure:<attempt>[:<rank>]`` fails a rank's first configure of its cross-group process group in
torchrun's attempt ``attempt`` only (its step field; 1 is the first restart), as when the peer group it was to
heal from died in that quorum: the rank does not heal. ``kill_first_configure:<attempt>[:<rank>]`` kills the rank
there instead, in that attempt only: its group died right after joining the quorum. A step may be a range ``A-B``
(``slow_step:6-40``). Several faults are separated by commas
(``sigterm_mid_async_save:20:1,slow_async_save:20``). With the variable unset, nothing happens. A fault
other than those three and ``wait_for_groups`` fires in the first attempt only: workers that torchrun restarts
(``TORCHELASTIC_RESTART_COUNT`` > 0) run through, so a restart can be shown to recover. ``wait_for_groups``
holds in every attempt: a fixed point a restarted group reaches is one all the same.
"""

from __future__ import annotations

import os
import signal
import time

import torch

ENV_VAR = "PARATRAIN_FAULT"
STALL_S = 3600.0
SLOW_WRITE_S = 2.0
SLOW_STEP_S = 0.5
LATE_MANAGER_S = 8.0


def maybe_stall(point: str, *, step: int, rank: int) -> None:
    """Sleeps for an hour at ``point`` (e.g. ``stall_in_step``), as a rank stuck in a step would."""
    if _fires(point, step=step, rank=rank):
        time.sleep(STALL_S)


def maybe_slow_down(point: str, *, step: int, rank: int, seconds: float = SLOW_WRITE_S) -> None:
    """Sleeps ``seconds`` at ``point`` (e.g. ``slow_async_save``), as slow storage would."""
    if _fires(point, step=step, rank=rank):
        time.sleep(seconds)


def maybe_late_on_restart(point: str, *, rank: int, seconds: float = LATE_MANAGER_S) -> None:
    """Sleeps ``seconds`` at ``point`` (``late_manager_on_restart``) in a restarted attempt only."""
    if _fires(point, step=0, rank=rank, in_restart=True):
        time.sleep(seconds)


def maybe_fail(point: str, *, rank: int) -> None:
    """Raises RuntimeError at ``point`` (``fail_first_configure``) in the attempt the spec names as its step."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if _fires(point, step=attempt, rank=rank, in_restart=attempt > 0):
        raise RuntimeError(f"{ENV_VAR}: {point} in attempt {attempt} on rank {rank}")


def maybe_kill_in_attempt(point: str, *, rank: int) -> None:
    """SIGKILL at ``point`` (``kill_first_configure``) in the attempt the spec names as its step."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if _fires(point, step=attempt, rank=rank, in_restart=attempt > 0):
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_poison_gradients(point: str, model: torch.nn.Module, *, step: int, rank: int) -> None:
    """Fills every gradient this rank holds with NaN at ``point`` (e.g. ``nan_grad``)."""
    if _fires(point, step=step, rank=rank):
        for param in model.parameters():
            if param.grad is not None:
                param.grad.detach().fill_(float("nan"))


def maybe_kill(point: str, *, step: int, rank: int) -> None:
    """SIGKILL at ``point``, or SIGTERM where the fault is named ``sigterm_<point>``."""
    if _fires(point, step=step, rank=rank):
        os.kill(os.getpid(), signal.SIGKILL)
    elif _fires(f"sigterm_{point}", step=step, rank=rank):
        os.kill(os.getpid(), signal.SIGTERM)


def fires(point: str, *, step: int, rank: int) -> bool:
    """Whether the fault ``point`` is set for this step and rank, in any attempt (for points whose action is
    not a kill, a stall or a sleep: ``wait_for_groups``)."""
    return _fires(point, step=step, rank=rank, in_restart=None)


def _fires(point: str, *, step: int, rank: int, in_restart: bool | None = False) -> bool:
    """Whether ``point`` is set for this step and rank, in the first attempt (``in_restart`` True: in a later
    one; None: in any)."""
    spec = os.environ.get(ENV_VAR)
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if not spec or (in_restart is not None and restarted != in_restart):
        return False
    return any(_matches(one, point=point, step=step, rank=rank) for one in spec.split(","))


def _matches(spec: str, *, point: str, step: int, rank: int) -> bool:
    fields = spec.split(":")
    if len(fields) not in (2, 3):
        raise ValueError(f"{ENV_VAR}={spec!r} must look like <point>:<step>[:<rank>]")
    rank_matches = len(fields) == 2 or int(fields[2]) == rank
    first, _, last = fields[1].partition("-")
    return fields[0] == point and int(first) <= step <= int(last or first) and rank_matches
