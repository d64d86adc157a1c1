"""The callback interface: hooks the training loop calls, on every rank, at fixed points of a run.

Order within a step: the step's optimizer update, then ``on_evaluation`` (eval steps only), then
``on_step_end`` (every step; ``context.record`` is the metrics record about to be logged on log steps,
and None otherwise), then ``on_checkpoint_saved`` (save steps only). ``on_train_start`` comes before the
first step, ``on_train_end`` after the last (also after an early stop; not when the run fails or is
preempted). Callbacks run in the order given: the config's ``callbacks`` list, then the Python API's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paratrain.trainer import Trainer

HOOKS = ("on_train_start", "on_step_end", "on_checkpoint_saved", "on_evaluation", "on_train_end")


@dataclass
class CallbackContext:
    """What a hook sees.

    Attributes:
        trainer: The Trainer (its model, optimizer, ``ctx`` with rank and device, ``config``).
        step: Optimizer steps done so far.
        record: On log steps, the metrics record (already reduced across ranks) that rank 0 writes to
            metrics.jsonl and TensorBoard: fields a callback adds are logged with it. None otherwise.
        checkpoint: ``on_checkpoint_saved``: the checkpoint directory (possibly still being written
            when checkpoint.async_save).
        eval_loss: ``on_evaluation``: the validation loss, the same on every rank.
    """

    trainer: Trainer
    step: int
    record: dict[str, Any] | None = None
    checkpoint: Path | None = None
    eval_loss: float | None = None
    _control: _Control = field(default=None, repr=False)

    def request_stop(self, reason: str) -> None:
        """Ends training after this step (with its final checkpoint). Every rank must request it at the
        same step, e.g. from a decision all-reduced across ranks as EarlyStopping does."""
        self._control.stop_reason = reason


class Callback:
    """Base class with a no-op for every hook: override the ones you need."""

    def on_train_start(self, context: CallbackContext) -> None: ...

    def on_step_end(self, context: CallbackContext) -> None: ...

    def on_checkpoint_saved(self, context: CallbackContext) -> None: ...

    def on_evaluation(self, context: CallbackContext) -> None: ...

    def on_train_end(self, context: CallbackContext) -> None: ...


@dataclass
class _Control:
    stop_reason: str | None = None


class CallbackList:
    """Calls each hook on every callback in order, and holds a stop requested by one of them."""

    def __init__(self, callbacks: list[Callback], trainer: Trainer):
        self.callbacks, self.trainer, self._control = list(callbacks), trainer, _Control()

    @property
    def stop_reason(self) -> str | None:
        return self._control.stop_reason

    def call(self, hook: str, **fields: Any) -> None:
        if not self.callbacks:
            return
        context = CallbackContext(self.trainer, self.trainer.progress.step, _control=self._control, **fields)
        for callback in self.callbacks:
            getattr(callback, hook)(context)
