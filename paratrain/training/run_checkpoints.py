"""The run's checkpoints as the loop uses them: the resume (chosen and checked when the run is built, so a
changed config is refused before anything runs; loaded when training starts), a save when one is due, and
the non-finite checks around both, and the record of each attempt in the run directory. What is due and which
checkpoint to take are decided from plain values by ``checkpoint.policy`` (``checkpoint.interval`` under
``every_steps: auto``, fed the measured time of saves and steps); this object acts on them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from paratrain.checkpoint.interval import AutoInterval
from paratrain.checkpoint.policy import build_auto_interval, build_checkpointer, choose_resume, load_resume, save_due
from paratrain.checkpoint.run_history import Outcome, record_end, record_start
from paratrain.checkpoint.state import OPTIONAL_STATE
from paratrain.config.schema import CheckpointConfig
from paratrain.launch.process_group import DistContext, local_world_size_from_env
from paratrain.nonfinite import NonFiniteWatch
from paratrain.parallel.collectives import all_gather_object

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
        self.output_dir, self.nodes = output_dir, max(1, ctx.world_size // local_world_size_from_env())
        self.checkpointer = build_checkpointer(options, directory=output_dir / "checkpoints", ctx=ctx, config=config)
        self.chosen = choose_resume(self.checkpointer, options, config=config, is_main=ctx.is_main)
        self.auto: AutoInterval | None = None  # under every_steps: auto, from the attempt's start
        self._resume_s = 0.0
        self._since = (time.perf_counter(), 0)  # the end of the last save (or the start), and its step

    def attempt_started(self, step: int) -> None:
        """Training starts, or resumes, at ``step``: recorded in the run directory (the failure history), and the
        automatic interval, if any, planned from it."""
        if self.is_main:
            record_start(self.output_dir, step=step, nodes=self.nodes)
        if self.options.every_steps == "auto":
            self.auto = build_auto_interval(
                self.options,
                output_dir=self.output_dir,
                nodes=self.nodes,
                restart_s=self._resume_s,
                is_main=self.is_main,
            )
        self._since = (time.perf_counter(), step)

    def attempt_ended(self, step: int, outcome: Outcome) -> None:
        """Training ended at ``step``, as ``outcome``: recorded (a failed one counts towards the failure rate)."""
        if self.is_main:
            try:
                record_end(self.output_dir, step=step, outcome=outcome)
            except OSError as error:  # never hides why training ended (a full disk, say)
                logger.warning("could not record the end of this attempt in %s: %s", self.output_dir, error)

    def resume(self) -> Path:
        """Loads the chosen checkpoint, or under ``resume: auto`` an older one when it proves damaged; returns
        the one loaded."""
        started = time.perf_counter()
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
        self._resume_s = time.perf_counter() - started
        return loaded

    def maybe_save(
        self, step: int, model: nn.Module, *, max_steps: int, ending_early: bool, preempted: bool
    ) -> Path | None:
        """Writes checkpoint step-<step> when one is due (see ``save_due``), once every weight of ``model``
        is checked finite; returns its path, or None when none was due."""
        due = save_due(
            step, self.options, max_steps=max_steps, ending_early=ending_early, preempted=preempted, auto=self.auto
        )
        if due is None:
            return None
        started = time.perf_counter()
        self.health.check_weights(model, step=step)
        path = self.checkpointer.save(step, self.state(), blocking=due.blocking, weights_finite=True)
        self.health.last_healthy_checkpoint = path
        logger.info("saved checkpoint %s" if due.blocking else "saving checkpoint %s in the background", path)
        if due.periodic and self.auto is not None:
            self._plan_again(step, started=started)
        self._since = (time.perf_counter(), step)
        return path

    def _plan_again(self, step: int, *, started: float) -> None:
        """Hands the automatic interval this save's blocking time and the mean time of the steps before it, the
        slowest rank's of each (so every rank plans the same), and logs a new plan."""
        since, since_step = self._since
        measured = (time.perf_counter() - started, (started - since) / max(1, step - since_step))
        save_cost_s, step_time_s = (max(values) for values in zip(*all_gather_object(measured)))
        assert self.auto is not None
        previous = self.auto.plan
        plan = self.auto.saved(step, save_cost_s=save_cost_s, step_time_s=step_time_s)
        if plan is not None and self.is_main:
            logger.info("checkpoint interval: %s", plan.describe(previous=previous))

    def load(self, path: Path) -> None:
        """Loads ``path`` as a resume does, without the fallback: a damaged file raises (DamagedCheckpointError)."""
        self.checkpointer.load(path, self.state(), optional=OPTIONAL_STATE)
