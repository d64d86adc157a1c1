"""The non-finite guard: no optimizer step with NaN/Inf gradients, no checkpoint of NaN/Inf weights.

The step already computes the global gradient norm for clipping (``paratrain.gradients``); it is NaN or
infinite exactly when some gradient on some rank is, and it is the same number on every rank (data-parallel
gradients are reduced first, shards and pipeline stages are summed into it). So every rank reaches the same
verdict from a value the step computes anyway, with no collective of its own. Reading that one scalar on the
host is the guard's only cost per step; the weights are checked (one all-reduce) only when a checkpoint is
about to be written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.parallel.collectives import all_reduce_sum

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

    def reason(self) -> str:
        if self.mode == "skip":
            return f"{self.consecutive} steps in a row had non-finite gradients (train.nonfinite_max_skips)"
        return "the gradient norm is not finite (NaN or Inf); the step was not applied"


def grads_are_finite(grad_norm: torch.Tensor) -> bool:
    """Whether the step's global gradient norm (equal on every rank) is finite: one scalar read on the host."""
    return bool(torch.isfinite(grad_norm))


def weights_are_finite(model: nn.Module) -> bool:
    """Whether every parameter on every rank is finite (one all-reduce; called before a checkpoint)."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    device = local[0].device if local else torch.device("cpu")
    bad = torch.zeros((), device=device)
    for tensor in local:
        bad += (~torch.isfinite(tensor.detach())).any()
    return all_reduce_sum(bad).item() == 0
