"""Which checkpoint a run resumes from (``choose_resume``), falls back to when a load finds a damaged file
(``previous_loadable``), or exports (``latest_verified``): what rank 0 decides, every rank agrees on."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paratrain.checkpoint.manifest import (
    check_checkpoint,
    find_checkpoints,
    is_complete,
    read_manifest,
    verify_checkpoint,
)
from paratrain.errors import CheckpointError
from paratrain.parallel.collectives import broadcast_object

logger = logging.getLogger(__name__)


def choose_resume(directory: Path, resume: str, *, rank: int) -> Path | None:
    """The checkpoint to resume from (decided on rank 0, agreed by all ranks), checked up to what needs
    no reading of its data (``check_checkpoint``): the load checks each file's checksum as it reads it."""
    return _decided_on_main(lambda: _choose(directory, resume), rank=rank)


def previous_loadable(directory: Path, damaged: Path, *, rank: int) -> Path:
    """The checkpoint ``resume: auto`` falls back to when loading ``damaged`` found a damaged file: the
    newest older one that passes ``check_checkpoint`` (decided on rank 0, agreed by all ranks).

    Raises:
        CheckpointError: no older checkpoint passes (starting over would hide that).
    """
    older_than = int(damaged.name.removeprefix("step-"))
    return _decided_on_main(
        lambda: _newest_passing(directory, check_checkpoint, older_than=older_than, found_damaged=True), rank=rank
    )


def latest_verified(directory: Path) -> Path | None:
    """Newest complete checkpoint whose files all check out (every byte hashed); damaged ones are
    skipped, loudly.

    Raises:
        CheckpointError: checkpoints exist but none verifies (starting over would hide that).
    """
    return _newest_passing(directory, verify_checkpoint)


def newest_complete(directory: Path) -> Path | None:
    """The checkpoint ``resume: auto`` takes, as far as its manifest tells (files are not re-hashed)."""
    for _, path in reversed(find_checkpoints(directory)):
        try:
            if is_complete(path) and read_manifest(path).get("weights_finite") is not False:
                return path
        except CheckpointError:
            continue
    return None


def _choose(directory: Path, resume: str) -> Path | None:
    if resume == "never":
        return None
    if resume == "auto":
        return _newest_passing(directory, check_checkpoint)
    check_checkpoint(Path(resume))
    return Path(resume)


def _decided_on_main(decide: Callable[[], Path | None], *, rank: int) -> Path | None:
    """decide()'s result on rank 0, agreed by every rank; a CheckpointError it raises is raised on every rank."""
    decision = None
    if rank == 0:
        try:
            chosen = decide()
            decision = str(chosen) if chosen else None
        except CheckpointError as error:
            decision = f"error:{error}"
    decision = broadcast_object(decision)
    if isinstance(decision, str) and decision.startswith("error:"):
        raise CheckpointError(decision.removeprefix("error:"))
    return Path(decision) if decision else None


def _newest_passing(
    directory: Path,
    check: Callable[[Path], dict[str, Any]],
    *,
    older_than: int | None = None,
    found_damaged: bool = False,
) -> Path | None:
    """Newest complete checkpoint (older than step ``older_than``) that passes ``check`` and was saved
    with finite weights; the others are skipped, loudly.

    Raises:
        CheckpointError: checkpoints exist (or one was ``found_damaged`` by a load) but none passes.
    """
    complete = [
        path
        for step, path in reversed(find_checkpoints(directory))
        if is_complete(path) and (older_than is None or step < older_than)
    ]
    for path in complete:
        try:
            manifest = check(path)
        except CheckpointError as error:
            logger.warning("skipping damaged checkpoint: %s; falling back to the previous one", error)
            continue
        if manifest.get("weights_finite") is False:
            logger.warning("skipping checkpoint %s: its weights are not finite; falling back to the previous one", path)
            continue
        return path
    if complete or found_damaged:
        raise CheckpointError(
            f"no checkpoint in {directory} verifies; set checkpoint.resume=never with a new "
            f"run.output_dir to start over"
        )
    return None
