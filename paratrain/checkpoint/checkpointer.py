"""Saving, finding, verifying, loading and rotating checkpoints under ``output_dir/checkpoints/``."""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.stateful import Stateful

from paratrain import faults
from paratrain.checkpoint.manifest import is_complete, read_manifest, verify_checkpoint, write_manifest
from paratrain.checkpoint.safe_reader import SafeFileSystemReader, SafeLoadPlanner
from paratrain.collectives import barrier, broadcast_object, is_distributed
from paratrain.errors import CheckpointError

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")


def find_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step-<N> directory, complete or not, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


class Checkpointer:
    """Writes step-<N> directories with DCP and decides which one a run resumes from.

    Args:
        directory: The run's ``checkpoints/`` directory, on storage every rank can reach.
        keep_last: Complete checkpoints to keep, or None for all.
        rank: This process's global rank; rank 0 marks completion and rotates.
        world_size: Recorded in each manifest.
        config: The resolved config, recorded in each manifest.
    """

    def __init__(self, directory: Path, *, keep_last: int | None, rank: int, world_size: int, config: dict[str, Any]):
        self.directory = directory
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size
        self.config = config

    def save(self, step: int, state: dict[str, Stateful]) -> Path:
        path = self.directory / f"step-{step}"
        if self.rank == 0:
            # DCP must write into a fresh directory; a leftover from a crashed attempt is not trusted.
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        barrier()
        with quiet_single_process():
            dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=not is_distributed())
        faults.maybe_kill("mid_save", step=step, rank=self.rank)
        barrier()  # every rank's data is on disk before rank 0 declares the checkpoint complete
        if self.rank == 0:
            write_manifest(path, step=step, config=self.config, world_size=self.world_size)
            self._rotate()
        barrier()
        return path

    def load(self, path: Path, state: dict[str, Stateful], *, optional: tuple[str, ...] = ()) -> None:
        """Loads state saved under any layout and world size into this one (DCP reshards).

        Entries named in ``optional`` are loaded only if the checkpoint has them for this rank (RNG
        states are saved per rank, so a run resumed on more ranks has none for the new ones).
        """
        saved_keys = SafeFileSystemReader(path).read_metadata().state_dict_metadata.keys()
        missing = [name for name in optional if name in state and not _saved(state[name], name, saved_keys)]
        for name in missing:
            logger.warning("%s holds no %r state for rank %d (saved by %s ranks); it starts fresh",
                           path, name, self.rank, read_manifest(path).get("world_size", "?"))
        loadable = {name: value for name, value in state.items() if name not in missing}
        with quiet_single_process():
            dcp.load(loadable, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(),
                     no_dist=not is_distributed())

    def choose_resume(self, resume: str) -> Path | None:
        """The verified checkpoint to resume from (decided on rank 0, agreed by all ranks)."""
        decision = self._choose_on_main(resume) if self.rank == 0 else None
        decision = broadcast_object(decision)
        if isinstance(decision, str) and decision.startswith("error:"):
            raise CheckpointError(decision.removeprefix("error:"))
        return Path(decision) if decision else None

    def _choose_on_main(self, resume: str) -> str | None:
        try:
            if resume == "never":
                return None
            if resume == "auto":
                latest = self.latest_verified()
                return str(latest) if latest else None
            verify_checkpoint(Path(resume))
            return resume
        except CheckpointError as error:
            return f"error:{error}"

    def latest_verified(self) -> Path | None:
        """Newest complete checkpoint whose files check out; damaged ones are skipped, loudly.

        Raises:
            CheckpointError: checkpoints exist but none verifies (starting over would hide that).
        """
        complete = [path for _, path in reversed(find_checkpoints(self.directory)) if is_complete(path)]
        for path in complete:
            try:
                verify_checkpoint(path)
                return path
            except CheckpointError as error:
                logger.warning("skipping damaged checkpoint: %s; falling back to the previous one", error)
        if complete:
            raise CheckpointError(
                f"no checkpoint in {self.directory} verifies; set checkpoint.resume=never with a new "
                f"run.output_dir to start over"
            )
        return None

    def _rotate(self) -> None:
        """Deletes complete checkpoints beyond keep_last, and incomplete ones older than the newest
        complete one (left by crashed saves). The newest complete one is never deleted."""
        all_found = find_checkpoints(self.directory)
        complete = [(step, path) for step, path in all_found if is_complete(path)]
        if not complete:
            return
        newest_step = complete[-1][0]
        doomed = complete[: -self.keep_last] if self.keep_last else []
        doomed += [(step, path) for step, path in all_found if step < newest_step and not is_complete(path)]
        for _, path in doomed:
            shutil.rmtree(path, ignore_errors=True)


def _saved(stateful: Stateful, name: str, saved_keys) -> bool:
    """Whether every top-level entry of the stateful's state is in the checkpoint."""
    prefixes = [f"{name}.{key}" for key in stateful.state_dict()]
    return all(any(saved == p or saved.startswith(p + ".") for saved in saved_keys) for p in prefixes)


@contextlib.contextmanager
def quiet_single_process():
    """DCP warns on every call without a process group; a lone process has none on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
