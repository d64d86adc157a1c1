"""Errors a user can fix, and the other ways a run ends early. The CLI prints their message alone,
without a traceback, and exits with the documented code."""

from __future__ import annotations

import errno as errno_module
import os
from pathlib import Path

EXIT_USER_ERROR = 2  # the documented exit code for bad input
EXIT_REQUEUE = 75  # EX_TEMPFAIL: stopped on SIGTERM/SIGUSR1 after saving a checkpoint; requeue to continue
EXIT_HANG = 124  # as timeout(1): a step exceeded debug.step_timeout_s; stacks in output_dir/hang/
EXIT_NONFINITE = 3  # training diverged: non-finite gradients or weights (train.nonfinite); nothing bad was saved
EXIT_SAVE_FAILED = 74  # EX_IOERR: a checkpoint could not be written (disk full, quota, read-only, permissions)
EXIT_PEER_RESTARTED = 76  # a worker on another node restarted; this one ends so torchrun restarts it too
EXIT_GROUP_RESTART = 77  # a replica group's worker ends so that torchrun restarts its group whole (it heals then)


class ConfigError(ValueError):
    """Bad input found before training starts: the message names the key, the value and the fix."""


class UserCodeError(Exception):
    """The user's own code (a model, data, loss, eval or callback factory) raised: reported once, by rank 0,
    as one block naming the factory, the exception and the user's own frames; exit code 2."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted or loaded: the message names the file and what to do."""


class Preempted(Exception):
    """Every rank stopped at the same step on SIGTERM or SIGUSR1 and saved a checkpoint of it.

    Attributes:
        step: The step the run stopped after.
        checkpoint: The complete checkpoint of that step.
        signal_name: The signal that asked for the stop (e.g. ``SIGTERM``).
    """

    def __init__(self, *, step: int, checkpoint: Path, signal_name: str):
        super().__init__(
            f"stopped at step {step} on {signal_name} after saving {checkpoint}; exit code {EXIT_REQUEUE}: "
            f"requeue the job and checkpoint.resume=auto continues from there"
        )
        self.step, self.checkpoint, self.signal_name = step, checkpoint, signal_name


class LighthouseLost(Exception):
    """A replica group stopped because no quorum formed for longer than
    ``parallel.fault_tolerance.lighthouse_wait_s`` (the lighthouse died and did not come back). Every step it
    took before is committed; the run continues from checkpoints once the lighthouse is back.

    Attributes:
        step: The last step the group took.
    """

    def __init__(self, *, step: int, group: int, waited_s: float, lighthouse: str, answers: bool, cause: str):
        state = "answers but formed no quorum" if answers else "does not answer"
        super().__init__(
            f"replica group {group} stopped after step {step}: no quorum for {waited_s:.0f} s "
            f"(parallel.fault_tolerance.lighthouse_wait_s); the lighthouse at {lighthouse} {state} ({cause}); "
            f"exit code {EXIT_REQUEUE}. Start the lighthouse again at that address, then the groups with "
            f"checkpoint.resume=auto: each resumes from its newest checkpoint and a group behind heals from the "
            f"newest (or raise lighthouse_wait_s to ride out longer outages)"
        )
        self.step = step


class StoppedAwaitingQuorum(Exception):
    """A replica group's rank was asked to stop (SIGTERM, SIGUSR1) while its quorum request was failing. With no
    quorum there is no step boundary for the group's ranks to stop at together, and the usual sender is torchrun,
    stopping the group because one of its ranks died: the rank hosting the group's torchft manager, whose loss
    is what failed the request. The rank stops at once instead of asking again until ``lighthouse_wait_s``, which
    held the group's restart back until torchrun's grace period ran out (24 s in a chaos run)."""

    def __init__(self, *, step: int, group: int, signal_name: str, cause: str):
        super().__init__(
            f"replica group {group} stopped after step {step}: {signal_name} received while no quorum formed for "
            f"step {step + 1} ({cause}); every step before is committed, and the group's restart heals from a live "
            f"group or resumes from its newest checkpoint"
        )


class IncompleteHeal(Exception):
    """Some ranks of a replica group received a live peer's state as it started and others did not (a peer
    group died while this one healed: the ranks that were to heal from it could not reach it). The healed
    ranks would take a step the others never join; the group stops instead, and its restart heals it whole."""

    def __init__(self, *, group: int, healed: int, ranks: int):
        super().__init__(
            f"replica group {group}: {healed} of its {ranks} ranks received a live peer's state and the others did "
            f"not (a peer group died while this one healed); stopping the group so that its restart heals every "
            f"rank (torchrun's --max-restarts, or the scheduler's requeue)"
        )


class NonFiniteStop(Exception):
    """Every rank stopped at the same step because gradients or weights were not finite.

    No optimizer step was applied with those gradients and no checkpoint of non-finite weights was written.

    Attributes:
        step: The step whose gradients (or weights) were not finite.
        checkpoint: The newest healthy checkpoint a resume would continue from (None: there is none).
    """

    def __init__(self, *, step: int, reason: str, checkpoint: Path | None):
        resume = (
            f"the last healthy checkpoint is {checkpoint} (checkpoint.resume=auto continues from it)"
            if checkpoint
            else "no healthy checkpoint was written yet"
        )
        super().__init__(
            f"stopped at step {step}: {reason}; exit code {EXIT_NONFINITE}; {resume}. Lower optim.lr, set "
            f"train.grad_clip, or train.nonfinite=skip to skip such steps"
        )
        self.step, self.checkpoint = step, checkpoint


class CheckpointWriteError(Exception):
    """Every rank stopped because the storage refused a checkpoint (disk full, quota, read-only, permissions).

    The incomplete checkpoint directory was removed; the complete ones before it are untouched.

    Attributes:
        step: The step whose checkpoint failed.
        path: The directory (or file) the storage refused.
        errno: The OSError's errno (e.g. ``errno.ENOSPC``).
        checkpoint: The newest complete checkpoint, which a resume continues from (None: there is none).
    """

    def __init__(self, *, step: int, path: Path, errno: int, checkpoint: Path | None, fix: str):
        resume = (
            f"checkpoint.resume=auto continues from {checkpoint}, the newest complete checkpoint"
            if checkpoint
            else "no complete checkpoint exists yet, so a new run starts from step 0"
        )
        super().__init__(
            f"checkpoint step-{step} was not saved: {os.strerror(errno)} ({_errno_name(errno)}) writing {path}; "
            f"the incomplete step-{step} was removed and {resume}; exit code {EXIT_SAVE_FAILED}. {fix}"
        )
        self.step, self.path, self.errno, self.checkpoint = step, path, errno, checkpoint


def _errno_name(number: int) -> str:
    return errno_module.errorcode.get(number, str(number))


# How each way a run ends early leaves the process: the one map both entries (the CLI, and each rank of a
# launched job) exit by.
EXIT_CODES: dict[type[Exception], int] = {
    ConfigError: EXIT_USER_ERROR,
    CheckpointError: EXIT_USER_ERROR,
    UserCodeError: EXIT_USER_ERROR,
    Preempted: EXIT_REQUEUE,
    LighthouseLost: EXIT_REQUEUE,
    NonFiniteStop: EXIT_NONFINITE,
    CheckpointWriteError: EXIT_SAVE_FAILED,
    StoppedAwaitingQuorum: EXIT_GROUP_RESTART,
    IncompleteHeal: EXIT_GROUP_RESTART,
}
RUN_ENDINGS = tuple(EXIT_CODES)


def exit_code_of(error: Exception) -> int:
    """The documented exit code of an error in RUN_ENDINGS."""
    return next(code for kind, code in EXIT_CODES.items() if isinstance(error, kind))
