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
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # types only: the interface loads neither torch.distributed nor the trainer
    import torch
    from torch import nn

    from paratrain.checkpoint.state import Progress
    from paratrain.config.schema import Config
    from paratrain.launch.process_group import DistContext
    from paratrain.parallel.dims import ParallelDims


class TrainerView(Protocol):
    """What a callback sees of the trainer: the attributes the built-in callbacks read and the ones this
    interface promises users' callbacks. The object passed is the Trainer itself; this view is how the
    callbacks name it without importing it (the trainer imports callbacks, never the other way round).

    Attributes:
        config: The resolved root config.
        ctx: This rank's process: ``rank``, ``world_size``, ``device``, ``is_main``.
        dims: The parallel degrees and their meshes.
        model: What forward runs through (the layout's wrapper, if any).
        bare_model: The parameters under the model's own names (this rank's pieces under a pipeline).
        optimizer: The optimizer over ``bare_model``'s parameters.
        devices: The devices this rank computes on, its own first.
        tokens_per_sample: Tokens in one sample when inputs are token ids, else None.
        progress: Optimizer steps done (``progress.step``).
    """

    config: Config
    ctx: DistContext
    dims: ParallelDims
    model: nn.Module
    bare_model: nn.Module
    optimizer: torch.optim.Optimizer
    devices: list[torch.device]
    tokens_per_sample: int | None
    progress: Progress


HOOKS = ("on_train_start", "on_step_end", "on_checkpoint_saved", "on_evaluation", "on_train_end")


@dataclass
class CallbackContext:
    """What a hook sees.

    Attributes:
        trainer: The Trainer, seen through :class:`TrainerView` (its model, optimizer, ``ctx`` with rank
            and device, ``config``).
        step: Optimizer steps done so far.
        record: On log steps, the metrics record (already reduced across ranks) that rank 0 writes to
            metrics.jsonl and TensorBoard: fields a callback adds are logged with it. None otherwise.
        checkpoint: ``on_checkpoint_saved``: the checkpoint directory (possibly still being written
            when checkpoint.async_save).
        eval_loss: ``on_evaluation``: the validation loss, the same on every rank.
    """

    trainer: TrainerView
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

    def __init__(self, callbacks: list[Callback], trainer: TrainerView):
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
