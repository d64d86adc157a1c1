"""The run's checkpoints as the loop uses them: the resume (chosen and checked when the run is built, so a
changed config is refused before anything runs; loaded when training starts), a save when one is due, and
the non-finite checks around both. What is due and which checkpoint to take are decided from plain values
by ``checkpoint.policy``; this object acts on them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from paratrain.checkpoint.policy import build_checkpointer, choose_resume, load_resume, save_due
from paratrain.checkpoint.state import OPTIONAL_STATE
from paratrain.config.schema import CheckpointConfig
from paratrain.launch.process_group import DistContext
from paratrain.nonfinite import NonFiniteWatch

logger = logging.getLogger("paratrain")


class RunCheckpoints:
    """Saves, resumes and loads one run's checkpoints.

    Args:
        options: The ``checkpoint`` section.
        output_dir: ``run.output_dir``: checkpoints go under its ``checkpoints/``.
        ctx: This rank's process (rank, world size, device).
        config: The resolved config as plain values: recorded in each manifest, compared with a resume's.
        state: Every Stateful of a resume, under the names checkpoints store them by (the trainer's).
        health: The run's non-finite watch: weights checked before each save, the last healthy checkpoint kept.
    """

    def __init__(
        self,
        options: CheckpointConfig,
        output_dir: Path,
        *,
        ctx: DistContext,
        config: dict[str, Any],
        state: Callable[[], dict[str, Any]],
        health: NonFiniteWatch,
    ):
        self.options, self.config, self.state, self.health, self.is_main = options, config, state, health, ctx.is_main
        self.checkpointer = build_checkpointer(options, directory=output_dir / "checkpoints", ctx=ctx, config=config)
        self.chosen = choose_resume(self.checkpointer, options, config=config, is_main=ctx.is_main)

    def resume(self) -> Path:
        """Loads the chosen checkpoint, or under ``resume: auto`` an older one when it proves damaged; returns
        the one loaded."""
        loaded = load_resume(
            self.checkpointer,
            self.chosen,
            self.state(),
            options=self.options,
            config=self.config,
            is_main=self.is_main,
            optional=OPTIONAL_STATE,
        )
        self.health.last_healthy_checkpoint = loaded
        return loaded

    def maybe_save(
        self, step: int, model: nn.Module, *, max_steps: int, ending_early: bool, preempted: bool
    ) -> Path | None:
        """Writes checkpoint step-<step> when one is due (see ``save_due``), once every weight of ``model``
        is checked finite; returns its path, or None when none was due."""
        due = save_due(step, self.options, max_steps=max_steps, ending_early=ending_early, preempted=preempted)
        if due is None:
            return None
        self.health.check_weights(model, step=step)
        path = self.checkpointer.save(step, self.state(), blocking=due.blocking, weights_finite=True)
        self.health.last_healthy_checkpoint = path
        logger.info("saved checkpoint %s" if due.blocking else "saving checkpoint %s in the background", path)
        return path

    def load(self, path: Path) -> None:
        """Loads ``path`` as a resume does, without the fallback: a damaged file raises (DamagedCheckpointError)."""
        self.checkpointer.load(path, self.state(), optional=OPTIONAL_STATE)
