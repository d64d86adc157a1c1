"""EarlyStopping: stop when a logged metric has stopped improving, at the same step on every rank."""

from __future__ import annotations

import logging
import math
from typing import Literal

import torch

from paratrain.callbacks.base import Callback, CallbackContext
from paratrain.parallel.collectives import all_reduce_min_max

logger = logging.getLogger("paratrain")


class EarlyStopping(Callback):
    """Ends training once ``monitor`` has not improved by more than ``min_delta`` for ``patience``
    consecutive readings; the run then saves its final checkpoint as usual (checkpoint.save_final).

    A reading is the metric in a logged record: ``eval_loss`` on evaluation steps, or the training
    ``loss`` (or any field another callback adds) on log steps. Each rank decides, then the decisions
    are all-reduced (stop if any rank would), so every rank stops after the same step. Config:
    ``callbacks: [{factory: paratrain.callbacks.early_stopping:EarlyStopping, args: {monitor: eval_loss,
    patience: 3}}]``.

    Args:
        monitor: Name of the metrics-record field to watch.
        patience: Readings without improvement before stopping.
        min_delta: How much a reading must beat the best so far to count as an improvement.
        mode: ``min`` (lower is better, e.g. a loss) or ``max``.
    """

    def __init__(
        self,
        *,
        monitor: str = "eval_loss",
        patience: int = 3,
        min_delta: float = 0.0,
        mode: Literal["min", "max"] = "min",
    ):
        if patience < 1 or min_delta < 0 or mode not in ("min", "max"):
            raise ValueError(
                f"EarlyStopping: patience={patience} must be >= 1, min_delta={min_delta} >= 0 and "
                f"mode={mode!r} 'min' or 'max'"
            )
        self.monitor, self.patience, self.min_delta, self.sign = (
            monitor,
            patience,
            min_delta,
            1.0 if mode == "min" else -1.0,
        )
        self.best, self.readings_without_improvement = math.inf, 0

    def on_step_end(self, context: CallbackContext) -> None:
        if context.record is None or self.monitor not in context.record:
            return
        value = self.sign * float(context.record[self.monitor])
        if value < self.best - self.min_delta:
            self.best, self.readings_without_improvement = value, 0
        else:
            self.readings_without_improvement += 1
        wants_stop = float(self.readings_without_improvement >= self.patience)
        _, any_rank = all_reduce_min_max(torch.tensor([wants_stop], device=context.trainer.ctx.device))
        if any_rank.item():
            context.request_stop(
                f"{self.monitor} did not improve by more than {self.min_delta} for "
                f"{self.patience} reading(s) (best {self.sign * self.best:.6g})"
            )
