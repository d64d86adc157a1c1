"""How a training run uses checkpoints: its checkpointer, when the loop saves, and which checkpoint the run
resumes from. Decisions from the ``checkpoint`` section and plain numbers; the trainer acts on them (settles
its verdicts, checks its weights, calls ``save``). The one action here is the resume's load, since which
checkpoint a run resumes from is decided again when that load finds a damaged file."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratrain.checkpoint.checkpointer import Checkpointer
from paratrain.checkpoint.config_changes import check_resume_config, log_resume_changes
from paratrain.checkpoint.interval import AutoInterval
from paratrain.checkpoint.manifest import DamagedCheckpointError, read_manifest
from paratrain.checkpoint.run_history import read_history
from paratrain.errors import CheckpointError
from paratrain.parallel.collectives import broadcast_object

if TYPE_CHECKING:
    from paratrain.config.schema import CheckpointConfig
    from paratrain.launch.process_group import DistContext

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveDue:
    """A save the loop owes after this step.

    Attributes:
        blocking: Written before training goes on: always without ``async_save``, and for the last save of
            a run (the process is about to exit, so nothing may be left in the background).
        periodic: A save of the run's interval only (not also its last, nor a preemption's): what an
            automatic interval measures.
    """

    blocking: bool
    periodic: bool = False


def save_due(
    step: int,
    options: CheckpointConfig,
    *,
    max_steps: int,
    ending_early: bool = False,
    preempted: bool = False,
    auto: AutoInterval | None = None,
) -> SaveDue | None:
    """Whether ``step`` (just taken) ends with a save, and how; None when it does not.

    Args:
        step: The step just taken.
        options: The ``checkpoint`` section (every_steps, save_final, async_save).
        max_steps: ``train.max_steps``: the run's last step.
        ending_early: A callback asked to stop after this step: it is the run's last.
        preempted: Every rank agreed to stop on a signal: the checkpoint is what the next run resumes.
        auto: The interval under ``every_steps: auto`` (``build_auto_interval``).
    """
    last = step == max_steps or ending_early
    if options.every_steps == "auto":
        assert auto is not None, "every_steps: auto needs the run's AutoInterval"
        periodic = auto.due(step)
    else:
        periodic = bool(options.every_steps) and step % options.every_steps == 0
    if not (periodic or (options.save_final and last) or preempted):
        return None
    return SaveDue(blocking=not options.async_save or preempted or last, periodic=periodic and not (last or preempted))


def build_auto_interval(
    options: CheckpointConfig, *, output_dir: Path, nodes: int, restart_s: float, is_main: bool
) -> AutoInterval:
    """The interval of ``every_steps: auto``: the run's MTBF from ``mtbf_hours`` and the failures the run
    directory recorded (read on rank 0, the same on every rank), over ``nodes``; logged by rank 0.

    Args:
        restart_s: How long this attempt's resume took (0 when it did not resume): part of what a failure costs.
    """
    assert options.mtbf_hours is not None  # the schema refuses every_steps: auto without it
    history = broadcast_object(read_history(output_dir) if is_main else None)
    node_mtbf_hours = history.node_mtbf_hours(prior_hours=options.mtbf_hours)
    if is_main:
        logger.info(
            "checkpoint.every_steps=auto: MTBF %.3g h per node (checkpoint.mtbf_hours=%g pooled with %d failure(s) "
            "in %.3g node-hours recorded), %.3g h for the run's %d node(s); saving after the first step to measure "
            "a save",
            node_mtbf_hours,
            options.mtbf_hours,
            history.failures,
            history.node_hours,
            node_mtbf_hours / nodes,
            nodes,
        )
    return AutoInterval(mtbf_s=node_mtbf_hours * 3600 / nodes, restart_s=restart_s)


def choose_resume(
    checkpointer: Checkpointer, options: CheckpointConfig, *, config: dict[str, Any], is_main: bool
) -> Path | None:
    """The checkpoint ``checkpoint.resume`` names (``never``, ``auto``: the newest that passes the checks made
    before loading, or a path), agreed by every rank, once its config is checked against ``config``. Its
    files' checksums are checked by the load itself (``load_resume``).

    Raises:
        CheckpointError: the named checkpoint fails those checks, or none of the run's passes.
        ConfigError: the training math changed and ``checkpoint.allow_config_change`` is not set. Raised
            on every rank (a changed config would train neither run); the changes are listed by rank 0.
    """
    path = checkpointer.choose_resume(options.resume)
    if path is not None:
        _check_config(path, options, config=config, is_main=is_main)
    return path


def load_resume(
    checkpointer: Checkpointer,
    path: Path,
    state: dict[str, Any],
    *,
    options: CheckpointConfig,
    config: dict[str, Any],
    is_main: bool,
    optional: tuple[str, ...],
) -> Path:
    """Loads the checkpoint ``choose_resume`` chose into ``state``, each file checked as it is read; returns
    the checkpoint loaded.

    Under ``resume: auto``, a damaged file found by any rank makes every rank fall back, loudly, to the
    newest older checkpoint that passes the checks, as ``choose_resume`` skips one found damaged before
    loading; its config is checked as the first one's was. The damaged load may already have copied the
    files that checked out into the model and optimizer tensors: the fallback's load overwrites every one
    of them (the same run saved both, so they hold the same entries; anything loaded through
    ``load_state_dict``, such as the RNG states and the data position, was never touched).

    Raises:
        CheckpointError: a checkpoint named by path is damaged (naming the file), or no checkpoint to
            fall back to passes.
        ConfigError: as ``choose_resume``, for a checkpoint fallen back to.
    """
    while True:
        try:
            checkpointer.load(path, state, optional=optional)
            return path
        except DamagedCheckpointError as error:
            if options.resume != "auto":
                raise CheckpointError(f"checkpoint.resume={options.resume}: {error}") from None
            if is_main:
                logger.warning("skipping damaged checkpoint: %s; falling back to the previous one", error)
            path = checkpointer.previous_loadable(path)
            _check_config(path, options, config=config, is_main=is_main)


def _check_config(path: Path, options: CheckpointConfig, *, config: dict[str, Any], is_main: bool) -> None:
    changes = check_resume_config(
        read_manifest(path).get("config", {}), config, checkpoint=path, allow_change=options.allow_config_change
    )
    if is_main:
        log_resume_changes(changes, path)


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
