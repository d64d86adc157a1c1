"""Removing checkpoints beyond ``checkpoint.keep_last`` as each save completes, their files deleted off the
save's path."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

from paratrain.checkpoint.manifest import find_checkpoints, is_complete

_DELETING_PREFIX = ".deleting-"  # not a step-<N> name: no resume, check or export ever sees it


class Rotation:
    """Rank 0's rotation of a run's checkpoints.

    Args:
        directory: The run's ``checkpoints/`` directory.
        keep_last: Complete checkpoints to keep, or None for all.
    """

    def __init__(self, directory: Path, *, keep_last: int | None):
        self.directory, self.keep_last = directory, keep_last
        self._deleting: threading.Thread | None = None

    def rotate(self) -> None:
        """Deletes complete checkpoints beyond keep_last, and incomplete ones older than the newest
        complete one (left by crashed saves). The newest complete one is never deleted, nor is a save
        being written: rotation runs only as a save completes, and no other is in flight then.

        Each doomed directory is renamed out of ``find_checkpoints``' sight at once (a rename: no data
        moves), and its files are deleted by a background thread: unlinking a GB took ~0.1-0.2 s of every
        save (docs/benchmarks.md, checkpoint I/O). The next save, and ``close``, wait for that thread, so
        the space is free before another checkpoint is written. A crash mid-delete leaves a
        ``.deleting-*`` directory, removed by the next rotation.
        """
        all_found = find_checkpoints(self.directory)
        complete = [(step, path) for step, path in all_found if is_complete(path)]
        if not complete:
            return
        newest_step = complete[-1][0]
        doomed = complete[: -self.keep_last] if self.keep_last else []
        doomed += [(step, path) for step, path in all_found if step < newest_step and not is_complete(path)]
        hidden = [_hide_for_deletion(path) for _, path in doomed]
        hidden += [path for path in self.directory.glob(_DELETING_PREFIX + "*") if path not in hidden]
        if hidden:
            self._deleting = threading.Thread(
                target=_delete_all, args=(hidden,), name="paratrain-checkpoint-rotation", daemon=False
            )
            self._deleting.start()

    def wait(self) -> None:
        """Blocks until the files of checkpoints rotated out are deleted (``save`` and ``close`` do it)."""
        deleting, self._deleting = self._deleting, None
        if deleting is not None:
            deleting.join()


def _hide_for_deletion(path: Path) -> Path:
    """Renames a doomed checkpoint out of sight; where the rename fails, it is left for deletion in place."""
    hidden = path.with_name(_DELETING_PREFIX + path.name)
    try:
        shutil.rmtree(hidden, ignore_errors=True)  # left by a crash mid-delete of an earlier step-<N> of that name
        path.rename(hidden)
    except OSError:
        return path
    return hidden


def _delete_all(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
