"""Which failures of a save are the storage refusing it (disk full, quota, read-only, permissions), and
what the user can do about each.

torch hides the OSError. DCP wraps every rank's exception in a ``CheckpointException`` (a
BaseException), and ``torch.save`` into a full disk raises ``RuntimeError: [enforce fail at
inline_container.cc:...] unexpected pos`` with the OSError only as its ``__context__``, which DCP's
pickling between ranks drops. ``ErrnoKeepingWriter`` re-raises the OSError itself, so its errno
reaches every rank.
"""

from __future__ import annotations

import errno
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from paratrain.checkpoint.file_groups import GroupedFilesWriter

# What a failed save can raise: DCP gathers every rank's exception into a CheckpointException, a BaseException.
SAVE_FAILURES = (Exception, CheckpointException)

_FREE_SPACE = (
    "Free space on that filesystem (or lower checkpoint.keep_last), or set run.output_dir to a larger one, then resume"
)
_FIXES = {
    errno.ENOSPC: _FREE_SPACE,
    errno.EDQUOT: _FREE_SPACE.replace("Free space on", "Free space or raise your quota on"),
    errno.EROFS: "The filesystem is mounted read-only: set run.output_dir to a writable one, then resume",
    errno.EACCES: "This user may not write there: fix the directory's permissions or set run.output_dir elsewhere",
    errno.EPERM: "This user may not write there: fix the directory's permissions or set run.output_dir elsewhere",
}


def find_storage_error(error: BaseException) -> OSError | None:
    """The OSError behind ``error`` whose errno says the storage refused the write, or None.

    Looks through DCP's per-rank failures and every exception's cause and context.
    """
    pending: list[Any] = [error]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _FIXES:
            return current
        pending += [current.__cause__, current.__context__]
        if isinstance(current, CheckpointException):
            # each failure is (exception, traceback summary)
            pending += [failure[0] if isinstance(failure, tuple) else failure for failure in current.failures.values()]
    return None


def storage_fix(number: int) -> str:
    """What to do about a storage errno that find_storage_error returned."""
    return _FIXES[number]


class ErrnoKeepingWriter(GroupedFilesWriter):
    """DCP's file writer (the model's entries in files of their own), raising a storage OSError as itself (errno and file name survive pickling),
    not as torch's RuntimeError around it."""

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except Exception as error:
            raise_if_storage_error(error)
            raise

    def finish(self, metadata, results) -> None:
        try:
            super().finish(metadata, results)
        except Exception as error:
            raise_if_storage_error(error)
            raise


def raise_if_storage_error(error: Exception) -> None:
    found = find_storage_error(error)
    if found is not None:
        raise OSError(found.errno, found.strerror, found.filename) from error
