"""Loading a checkpoint saved under any layout and world size into this one (DCP reshards), every file
checked against the manifest while it is read (``VerifyingReader``), and the files no rank read checked after."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from paratrain.checkpoint.manifest import DamagedCheckpointError, read_manifest, verify_files
from paratrain.checkpoint.safe_reader import SafeLoadPlanner
from paratrain.checkpoint.state import SavedEntriesOnly, is_saved
from paratrain.checkpoint.verifying_reader import VerifyingReader
from paratrain.parallel.collectives import all_gather_object, is_distributed, quiet_single_process

logger = logging.getLogger(__name__)


def load_checkpoint(path: Path, state: dict[str, Stateful], *, rank: int, optional: tuple[str, ...] = ()) -> None:
    """Loads state saved under any layout and world size into this one (DCP reshards), checking every
    file of the checkpoint against its manifest: each file a rank reads as it reads it (VerifyingReader),
    then, on rank 0, the files no rank read.

    Entries named in ``optional`` are loaded only if the checkpoint has them for this rank (RNG
    states are saved per rank, so a run resumed on more ranks has none for the new ones).

    Raises:
        DamagedCheckpointError: on every rank, naming a damaged file. None of that file's bytes reached
            the state, but items of files that checked out before it may have: model and optimizer
            tensors are loaded in place. Entries loaded through ``load_state_dict`` (data position, step,
            RNG, scheduler) are untouched, since DCP calls it only after every read succeeded.
    """
    listed = read_manifest(path)["files"]
    reader = VerifyingReader(path, listed=listed)  # one reader: DCP's load reuses the metadata read here
    metadata = agree_on_damage(reader.read_metadata)
    saved_keys = metadata.state_dict_metadata.keys()
    missing = [name for name in optional if name in state and not _saved(state[name], name, saved_keys)]
    for name in missing:
        logger.warning(
            "%s holds no %r state for rank %d (saved by %s ranks); it starts fresh",
            path,
            name,
            rank,
            read_manifest(path).get("world_size", "?"),
        )
    loadable = {name: value for name, value in state.items() if name not in missing}
    partial = {name: SavedEntriesOnly(loadable[name], name, set(saved_keys)) for name in optional if name in loadable}
    loadable.update(partial)
    try:
        with quiet_single_process():
            dcp.load(loadable, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=not is_distributed())
    except CheckpointException as error:
        damaged = _damage_in(error)
        if damaged is None:
            raise
        raise damaged from None
    _verify_unread(path, listed, read_here=reader.verified, rank=rank)
    for entry in partial.values():
        if entry.absent:
            logger.warning("%s holds no %s (saved with fewer devices per rank); it starts fresh", path, entry.absent)


def _verify_unread(path: Path, listed: dict[str, dict[str, Any]], *, read_here: set[str], rank: int) -> None:
    """Rank 0 checks the files no rank read in this load (entries this run does not load, or a layout
    that needs only some of the files): a resume vouches for the whole checkpoint, as the full verify
    before the load did, so that a damaged file cannot wait, unnoticed, for a later resume under
    another layout or an export. Usually every file was read and this reads nothing."""
    read_anywhere = set().union(*all_gather_object(read_here))
    unread = {name: entry for name, entry in listed.items() if name not in read_anywhere}
    agree_on_damage(lambda: verify_files(path, unread) if rank == 0 and unread else None)


def agree_on_damage(action: Callable[[], Any]) -> Any:
    """action's result; a DamagedCheckpointError it raises on any rank is raised on every rank (the
    first rank's), so no rank goes on into a collective the others have left."""
    try:
        result, damage = action(), None
    except DamagedCheckpointError as error:
        result, damage = None, str(error)
    found = [message for message in all_gather_object(damage) if message]
    if found:
        raise DamagedCheckpointError(found[0])
    return result


def _saved(stateful: Stateful, name: str, saved_keys) -> bool:
    """Whether every top-level entry of the stateful's state is in the checkpoint."""
    prefixes = [f"{name}.{key}" for key in stateful.state_dict()]
    return all(is_saved(prefix, saved_keys) for prefix in prefixes)


def _damage_in(error: CheckpointException) -> DamagedCheckpointError | None:
    """The damaged file DCP's load failed on, if any: DCP gathers every rank's read failure into the
    CheckpointException raised on every rank, so each rank finds the same one (the lowest rank's)."""
    for _, (failure, _) in sorted(error.failures.items()):
        if isinstance(failure, DamagedCheckpointError):
            return failure
    return None
