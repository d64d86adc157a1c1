"""A test callback that records every hook it sees, on its rank, and checks each evaluation by hand.

Used in-process (tests/unit/test_callbacks_eval_profile.py) and under torchrun
(check_callbacks_eval_profile.py, which imports it as a sibling)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

from paratrain.callbacks import Callback, CallbackContext
from paratrain.callbacks.base import TrainerView


class RecordingCallback(Callback):
    """Appends [hook, step, detail] per call; writes them to ``events_path`` at train end.

    Args:
        model_factory: Builds a fresh model, into which the trained weights are loaded to compute each
            evaluation's loss by hand.
        validation: The validation set, whole.
        probe: step -> value of a ``probe`` field added to each logged record (for early stopping).
    """

    def __init__(
        self,
        *,
        model_factory,
        validation: TensorDataset,
        loss_fn,
        events_path: Path | None = None,
        probe=None,
        max_samples: int | None = None,
    ):
        self.model_factory, self.validation, self.loss_fn = model_factory, validation, loss_fn
        self.events_path, self.probe, self.max_samples = events_path, probe, max_samples
        self.events: list[list[Any]] = []
        self.evaluations: list[dict[str, float]] = []
        self.missing_from_view: list[str] | None = None

    def on_train_start(self, context: CallbackContext) -> None:
        self.events.append(["train_start", context.step, None])
        # What TrainerView promises callbacks, read off the trainer actually passed.
        self.missing_from_view = [name for name in TrainerView.__annotations__ if not hasattr(context.trainer, name)]

    def on_step_end(self, context: CallbackContext) -> None:
        if context.record is not None and self.probe is not None:
            context.record["probe"] = self.probe(context.step)
        self.events.append(["step_end", context.step, "logged" if context.record is not None else None])

    def on_evaluation(self, context: CallbackContext) -> None:
        self.events.append(["evaluation", context.step, None])
        self.evaluations.append(
            {
                "step": context.step,
                "eval_loss": context.eval_loss,
                "by_hand": self.loss_by_hand(context.trainer.bare_model),
            }
        )

    def on_checkpoint_saved(self, context: CallbackContext) -> None:
        self.events.append(["checkpoint_saved", context.step, context.checkpoint.name])

    def on_train_end(self, context: CallbackContext) -> None:
        self.events.append(["train_end", context.step, None])
        if self.events_path is not None:
            self.events_path.write_text(json.dumps({"events": self.events, "evaluations": self.evaluations}))

    def loss_by_hand(self, trained: nn.Module) -> float:
        """The loss over the validation set (its first max_samples) in one batch, with the trained weights
        gathered into a fresh model in this process (a collective for sharded weights: every rank calls it)."""
        weights = {
            name: value.full_tensor() if isinstance(value, DTensor) else value
            for name, value in trained.state_dict().items()
        }
        model = self.model_factory()
        model.load_state_dict(weights)
        inputs, targets = self.validation.tensors
        with torch.no_grad():
            return self.loss_fn(model(inputs[: self.max_samples]), targets[: self.max_samples]).item()
