"""The non-finite guard: no optimizer step with NaN/Inf gradients, no checkpoint of NaN/Inf weights.

The step already computes the global gradient norm for clipping (``paratrain.gradients``); it is NaN or
infinite exactly when some gradient on some rank is, and it is the same number on every rank (data-parallel
gradients are reduced first, shards and pipeline stages are summed into it). So every rank reaches the same
verdict from a value the step computes anyway, with no collective of its own.

Where the verdict is used decides what it costs. A fused optimizer (CUDA's default, ``optim.fused``) takes
the verdict as a device tensor and skips the step on the device, as GradScaler does for fp16, so the host
never waits for the GPU; the loop reads each step's verdict one step late, once the next step's work is
queued, as it reads the preemption flag. Any other optimizer needs the verdict on the host before it steps
(free on CPU, one wait per step on a GPU). The weights are checked (one all-reduce) only when a checkpoint
is about to be written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from paratrain.config.schema import TrainConfig
from paratrain.errors import NonFiniteStop
from paratrain.parallel.collectives import all_reduce_sum, barrier
from paratrain.tensors import local_part

if TYPE_CHECKING:
    from paratrain.precision import MixedPrecision

logger = logging.getLogger("paratrain")


@dataclass
class NonFiniteGuard:
    """Decides, step by step, whether a step with non-finite gradients is skipped or ends the run.

    Args:
        mode: ``stop`` ends the run at the first such step; ``skip`` drops it and goes on.
        max_skips: Under ``skip``, this many such steps in a row end the run.
    """

    mode: Literal["stop", "skip"]
    max_skips: int
    consecutive: int = 0
    skipped_steps: list[int] = field(default_factory=list)

    def should_stop(self, step: int, *, finite: bool) -> bool:
        """Records the verdict on ``step``; True when the run must end here."""
        if finite:
            self.consecutive = 0
            return False
        self.consecutive += 1
        self.skipped_steps.append(step)
        if self.mode == "stop" or self.consecutive >= self.max_skips:
            return True
        logger.warning(
            "step %d skipped: the gradient norm is not finite (train.nonfinite=skip; %d in a row, the run stops at %d)",
            step,
            self.consecutive,
            self.max_skips,
        )
        return False

    def skipped_after(self, step: int) -> int:
        """How many steps after ``step`` were skipped (the same on every rank: so is each verdict)."""
        return sum(1 for skipped in self.skipped_steps if skipped > step)

    def reason(self) -> str:
        if self.mode == "skip":
            return f"{self.consecutive} steps in a row had non-finite gradients (train.nonfinite_max_skips)"
        return "the gradient norm is not finite (NaN or Inf); the step was not applied"


@dataclass
class PendingVerdicts:
    """Steps whose verdict is still on its way to the host, read in step order when settled.

    On a GPU each verdict is copied to pinned host memory as soon as it is computed, with an event behind
    the copy: reading it waits for that step's copy only, not for the steps queued since (``.item()``
    would wait for everything on the stream).
    """

    guard: NonFiniteGuard
    pending: list[tuple[int, torch.Tensor, torch.cuda.Event | None]] = field(default_factory=list)

    def add(self, step: int, finite: torch.Tensor) -> None:
        if finite.device.type != "cuda":
            self.pending.append((step, finite, None))
            return
        host = torch.empty((), dtype=torch.bool, pin_memory=True)
        host.copy_(finite, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self.pending.append((step, host, copied))

    def settle(self, *, keep_newest: bool = False) -> int | None:
        """Reads the pending verdicts (all but the newest, whose step may still be running, if keep_newest);
        returns the step at which the run must stop, or None."""
        ready, self.pending = (self.pending[:-1], self.pending[-1:]) if keep_newest else (self.pending, [])
        for step, finite, copied in ready:
            if copied is not None:
                copied.synchronize()
            if self.guard.should_stop(step, finite=bool(finite)):
                self.pending = []
                return step
        return None


class NonFiniteWatch:
    """The loop's side of the non-finite guard: each step's verdict read one step late (``PendingVerdicts``),
    every weight checked before a checkpoint is written, and a stop that names the last checkpoint whose
    weights were finite.

    Args:
        train: The ``train`` section (``nonfinite``, ``nonfinite_max_skips``).
        before_stopping: Runs before the run stops (the trainer finishes a save in flight: its weights were
            checked before it began).
    """

    def __init__(self, train: TrainConfig, *, before_stopping: Callable[[], object]):
        self.guard = NonFiniteGuard(train.nonfinite, train.nonfinite_max_skips)
        self.verdicts = PendingVerdicts(self.guard)
        self.before_stopping = before_stopping
        self.last_healthy_checkpoint: Path | None = None  # what a stop names

    def step_done(self, step: int, finite: torch.Tensor) -> None:
        """Queues the step's verdict and reads the previous step's, while this one runs."""
        self.verdicts.add(step, finite)
        self.settle(keep_newest=True)

    def settle(self, *, keep_newest: bool = False) -> None:
        """Reads the pending verdicts (see PendingVerdicts).

        Raises:
            NonFiniteStop: a verdict ends the run.
        """
        stop_at = self.verdicts.settle(keep_newest=keep_newest)
        if stop_at is not None:
            self.before_stopping()
            raise stop_on_nonfinite(self.guard.reason(), step=stop_at, checkpoint=self.last_healthy_checkpoint)

    def check_weights(self, model: nn.Module, *, step: int) -> None:
        """Before checkpoint step-<step> is written: every verdict is read, and every weight is finite.

        Raises:
            NonFiniteStop: a step's verdict ends the run, or a weight is not finite (nothing is written).
        """
        self.settle()  # under stop, a step with non-finite gradients ends the run before any save
        if not weights_are_finite(model):
            self.before_stopping()
            reason = f"the weights are not finite, so checkpoint step-{step} was not written"
            raise stop_on_nonfinite(reason, step=step, checkpoint=self.last_healthy_checkpoint)

    def applied_steps(self, steps: int, *, through_step: int) -> int:
        """Of the ``steps`` up to ``through_step``, those applied (not skipped): every verdict is read first."""
        self.settle()
        return steps - self.guard.skipped_after(through_step - steps)

    @property
    def skipped_steps(self) -> int:
        return len(self.guard.skipped_steps)


def step_unless_nonfinite(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> torch.Tensor:
    """Steps the optimizer unless ``grad_norm`` is NaN or infinite; returns the verdict (finite) as a tensor.

    A fused optimizer gets the verdict as ``found_inf`` (the attribute GradScaler sets) and skips on the
    device, leaving weights, moments and its step count as they were; the host does not wait. Others
    read the verdict on the host first.
    """
    finite = torch.isfinite(grad_norm)
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.grad_scale, optimizer.found_inf = None, (~finite).to(torch.float32)
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf
    elif bool(finite):
        optimizer.step()
    return finite


def weights_are_finite(model: nn.Module) -> bool:
    """Whether every parameter on every rank is finite (one all-reduce; called before a checkpoint)."""
    local = [local_part(p) for p in model.parameters()]
    device = local[0].device if local else torch.device("cpu")
    bad = torch.zeros((), device=device)
    for tensor in local:
        bad += (~torch.isfinite(tensor.detach())).any()
    return all_reduce_sum(bad).item() == 0


def step_optimizer(
    optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor, *, precision: MixedPrecision
) -> torch.Tensor:
    """Applies the step unless its gradients are not finite; returns that verdict, on the device.

    fp16's scaler skips overflowed steps itself (and shrinks its scale): expected, so not counted here.
    """
    if precision.scaler is not None:
        precision.step(optimizer)
        return torch.ones((), dtype=torch.bool, device=grad_norm.device)
    return step_unless_nonfinite(optimizer, grad_norm)


def stop_on_nonfinite(reason: str, *, step: int, checkpoint: Path | None) -> NonFiniteStop:
    """Says why and where the run stops on non-finite values (the verdict is the same on every rank) and
    returns the exception every rank ends with; ``checkpoint`` is the last one with finite weights."""
    stopped = NonFiniteStop(step=step, reason=reason, checkpoint=checkpoint)
    # Said here, and every rank waits for it: the first rank to exit makes the launcher stop the others,
    # and rank 0 could be stopped before printing a message left for after the exception.
    logger.info("error: %s", stopped)
    barrier()
    return stopped
