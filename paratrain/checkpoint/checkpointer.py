"""A run's checkpoints under ``output_dir/checkpoints/``: one object the trainer and the tools hold, made of
the writer (``writer.py``: save, async save, completion, rotation), the reader (``reader.py``: a verified,
resharding load) and the selection (``selection.py``: which checkpoint to resume from, fall back to or export).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from paratrain.checkpoint import selection
from paratrain.checkpoint.reader import load_checkpoint
from paratrain.checkpoint.writer import CheckpointWriter
from paratrain.launch.gc_pause import collections_paused


class Checkpointer:
    """Saves step-<N> directories, loads them under any layout, and decides which one a run resumes from.

    Args:
        directory: The run's ``checkpoints/`` directory, on storage every rank can reach.
        keep_last: Complete checkpoints to keep, or None for all.
        rank: This process's global rank; rank 0 marks completion, rotates and decides.
        world_size: Recorded in each manifest.
        config: The resolved config, recorded in each manifest.
        async_save: Allow ``save(..., blocking=False)`` (see CheckpointWriter).
        device: The run's device; async staging buffers are pinned when it is a GPU.
    """

    def __init__(
        self,
        directory: Path,
        *,
        keep_last: int | None,
        rank: int,
        world_size: int,
        config: dict[str, Any],
        async_save: bool = False,
        device: torch.device = torch.device("cpu"),
    ):
        self.directory, self.rank, self.config = directory, rank, config
        self.writer = CheckpointWriter(
            directory,
            keep_last=keep_last,
            rank=rank,
            world_size=world_size,
            config=config,
            async_save=async_save,
            device=device,
        )

    def save(
        self, step: int, state: dict[str, Stateful], *, blocking: bool = True, weights_finite: bool | None = None
    ) -> Path:
        """Writes ``step-<step>``; returns its path (see CheckpointWriter.save). Every rank calls it at the same step."""
        with collections_paused():
            return self.writer.save(step, state, blocking=blocking, weights_finite=weights_finite)

    def wait(self) -> Path | None:
        """Blocks until the save in flight, if any, is complete on every rank; returns its path."""
        return self.writer.wait()

    def close(self) -> None:
        """Waits for the save in flight and stops the background thread."""
        self.writer.close()

    def wait_for_rotation(self) -> None:
        """Blocks until the files of checkpoints rotated out are deleted."""
        self.writer.rotation.wait()

    def load(self, path: Path, state: dict[str, Stateful], *, optional: tuple[str, ...] = ()) -> None:
        """Loads ``path`` into ``state`` under this layout, every file verified (see reader.load_checkpoint)."""
        with collections_paused():
            load_checkpoint(path, state, rank=self.rank, optional=optional)

    def choose_resume(self, resume: str) -> Path | None:
        """The checkpoint to resume from (see selection.choose_resume)."""
        return selection.choose_resume(self.directory, resume, rank=self.rank)

    def previous_loadable(self, damaged: Path) -> Path:
        """The checkpoint ``resume: auto`` falls back to (see selection.previous_loadable)."""
        return selection.previous_loadable(self.directory, damaged, rank=self.rank)

    def latest_verified(self) -> Path | None:
        """Newest complete checkpoint whose files all check out (see selection.latest_verified)."""
        return selection.latest_verified(self.directory)

    def newest_complete(self) -> Path | None:
        """The checkpoint ``resume: auto`` takes, as far as its manifest tells."""
        return selection.newest_complete(self.directory)
