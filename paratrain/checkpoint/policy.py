"""How a training run uses checkpoints: its checkpointer, when the loop saves, and which checkpoint the run
resumes from. Decisions from the ``checkpoint`` section and plain numbers; the trainer acts on them (settles
its verdicts, checks its weights, calls ``save`` and ``load``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratrain.checkpoint.checkpointer import Checkpointer
from paratrain.checkpoint.config_changes import check_resume_config, log_resume_changes
from paratrain.checkpoint.manifest import read_manifest

if TYPE_CHECKING:
    from paratrain.config.schema import CheckpointConfig
    from paratrain.launch.process_group import DistContext


@dataclass(frozen=True)
class SaveDue:
    """A save the loop owes after this step.

    Attributes:
        blocking: Written before training goes on: always without ``async_save``, and for the last save of
            a run (the process is about to exit, so nothing may be left in the background).
    """

    blocking: bool


def save_due(
    step: int, options: CheckpointConfig, *, max_steps: int, ending_early: bool = False, preempted: bool = False
) -> SaveDue | None:
    """Whether ``step`` (just taken) ends with a save, and how; None when it does not.

    Args:
        step: The step just taken.
        options: The ``checkpoint`` section (every_steps, save_final, async_save).
        max_steps: ``train.max_steps``: the run's last step.
        ending_early: A callback asked to stop after this step: it is the run's last.
        preempted: Every rank agreed to stop on a signal: the checkpoint is what the next run resumes.
    """
    last = step == max_steps or ending_early
    periodic = bool(options.every_steps) and step % options.every_steps == 0
    if not (periodic or (options.save_final and last) or preempted):
        return None
    return SaveDue(blocking=not options.async_save or preempted or last)


def choose_resume(
    checkpointer: Checkpointer, options: CheckpointConfig, *, config: dict[str, Any], is_main: bool
) -> Path | None:
    """The checkpoint ``checkpoint.resume`` names (``never``, ``auto``: the newest verified, or a path),
    agreed by every rank, once its config is checked against ``config``.

    Raises:
        CheckpointError: the named checkpoint does not verify, or none of the run's does.
        ConfigError: the training math changed and ``checkpoint.allow_config_change`` is not set. Raised
            on every rank (a changed config would train neither run); the changes are listed by rank 0.
    """
    path = checkpointer.choose_resume(options.resume)
    if path is None:
        return None
    changes = check_resume_config(
        read_manifest(path).get("config", {}), config, checkpoint=path, allow_change=options.allow_config_change
    )
    if is_main:
        log_resume_changes(changes, path)
    return path


def build_checkpointer(
    options: CheckpointConfig, *, directory: Path, ctx: DistContext, config: dict[str, Any]
) -> Checkpointer:
    """The run's checkpointer for the ``checkpoint`` section (keep_last, async_save) on this rank's process
    and device (see Checkpointer); ``config``, the resolved config, goes into every manifest."""
    return Checkpointer(
        directory,
        keep_last=options.keep_last,
        rank=ctx.rank,
        world_size=ctx.world_size,
        config=config,
        async_save=options.async_save,
        device=ctx.device,
    )
