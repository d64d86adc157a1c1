"""SHA-256 of checkpoint files taken from the bytes as DCP writes them.

The manifest lists every file's SHA-256. Reading each file back after the write to hash it cost a
third of a synchronous save (docs/benchmarks.md, checkpoint I/O): the hash now runs over the very
bytes handed to the file, in DCP's writer threads, where hashlib releases the GIL. It is as strong a
check as the read-back was: that read came from the page cache, not from the disk, too. What the
manifest then adds is that the file on disk still has the size that was hashed (checked against its
stat), and a later ``verify_checkpoint`` re-reads everything.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from paratrain.checkpoint.storage_errors import ErrnoKeepingWriter, raise_if_storage_error

# Two files per rank and group of entries (file_groups), written and hashed by two threads: the hash (about
# 1.2 GB/s on one core) then no longer adds to the write on a machine with a second core (docs/benchmarks.md,
# checkpoint I/O).
WRITE_THREADS = 2


class _HashingFile(io.BufferedWriter):
    """A file opened for writing that hashes every byte written to it, in order."""

    def __init__(self, path: Path):
        super().__init__(io.FileIO(path, "wb"))
        self._sha256: Any = hashlib.sha256()
        self._bytes = 0

    def write(self, data) -> int:
        if self._sha256 is not None:
            self._sha256.update(data)
        written = super().write(data)
        self._bytes += written
        return written

    def seek(self, *args: Any) -> int:
        self._sha256 = None  # bytes may be overwritten: the file is hashed from the disk instead
        return super().seek(*args)

    def describe(self) -> dict[str, Any] | None:
        """The manifest's entry for the file, or None when the writes were not sequential."""
        if self._sha256 is None:
            return None
        return {"bytes": self._bytes, "sha256": self._sha256.hexdigest()}


class _HashingFileSystem(FileSystem):
    """DCP's local file system, recording name -> {bytes, sha256} of each file it wrote."""

    def __init__(self) -> None:
        self.written: dict[str, dict[str, Any]] = {}
        self.failures: list[BaseException] = []

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        try:
            with _HashingFile(path) as stream:
                yield stream
        except Exception as error:
            # Kept for write_data to raise once every writer thread is done: DCP's extra threads would
            # only print it (a traceback, and the save carrying on), and the calling thread's raise
            # would leave the others writing.
            self.failures.append(error)
            return
        described = stream.describe()  # recorded only once the write ended without error
        if described is not None:
            self.written[path.name] = described


class HashingWriter(ErrnoKeepingWriter):
    """DCP's file writer (the model's entries in files of their own, storage errors raised as themselves) that
    hashes what it writes.

    Args:
        path: The checkpoint directory.

    After the save, ``written`` maps each file this rank wrote to its size and SHA-256.
    """

    def __init__(self, path: Path):
        super().__init__(path, thread_count=WRITE_THREADS)
        self.fs = _HashingFileSystem()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """DCP's write, failing when any writer thread failed or any planned item went unwritten.

        With more than one thread, torch 2.13's ``FileSystemWriter`` returns normally when a thread other
        than the calling one fails (the disk fills up): the error is printed and that thread's items are
        missing from the results. Such a save must fail, not be marked complete.
        """
        written = super().write_data(plan, planner)
        if self.fs.failures:
            error = self.fs.failures[0]
            raise_if_storage_error(error)
            raise RuntimeError(f"a checkpoint writer thread failed: {error!r}") from error
        results = written.wait()
        if len(results) != len(plan.items):
            raise RuntimeError(f"the checkpoint writer wrote {len(results)} of {len(plan.items)} planned items")
        return written

    @property
    def written(self) -> dict[str, dict[str, Any]]:
        return self.fs.written
