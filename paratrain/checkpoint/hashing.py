"""DCP's file writer, for paratrain's checkpoints: each file checksummed from the very bytes written to it,
plain tensors written raw (``raw_tensors``), over ``WRITE_THREADS`` threads per rank.

Reading each file back after the write to hash it cost a third of a synchronous save (docs/benchmarks.md,
checkpoint I/O): the hash runs over the bytes handed to the file instead, in the writer threads. It is as
strong a check as the read-back was: that read came from the page cache, not from the disk, too. What the
manifest then adds is that the file on disk still has the size that was hashed (checked against its stat), and
a later ``verify_checkpoint`` re-reads everything.
"""

from __future__ import annotations

import io
import os
import queue
import threading
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from paratrain.checkpoint.checksums import entry_for, new_digest
from paratrain.checkpoint.raw_tensors import write_items
from paratrain.checkpoint.storage_errors import ErrnoKeepingWriter, raise_if_storage_error

# Threads, and so files, per rank and group of entries (file_groups). With checksums nearly free, a thread is
# the write itself: on the benchmark's virtual disk (2 cores) 2 threads saved faster than 1 and no slower than 4
# (benchmarks/checkpoint_io.py --compare-threads 1,4; docs/benchmarks.md, checkpoint I/O).
WRITE_THREADS = 2


class _ChecksummedFile(io.BufferedWriter):
    """A file opened for writing that checksums every byte written to it, in order."""

    def __init__(self, path: Path):
        super().__init__(io.FileIO(path, "wb"), buffer_size=1 << 20)
        self._digest: Any = new_digest()
        self._bytes = 0

    def write(self, data) -> int:
        self._digest.update(data)
        written = super().write(data)
        self._bytes += written
        return written

    def tell(self) -> int:
        # Written in order from the start, never seeked: the position is the count, with no lseek per item (a
        # tenth of a second per 2,000 items on a busy machine).
        return self._bytes

    def entry(self) -> dict[str, Any]:
        """The manifest's entry for the file."""
        return entry_for(self._bytes, self._digest)


class HashingWriter(ErrnoKeepingWriter):
    """DCP's file writer (the model's entries in files of their own, storage errors raised as themselves) that
    writes plain tensors raw and checksums what it writes.

    Args:
        path: The checkpoint directory.
        thread_count: Writer threads, each writing whole files, so also the files per group of entries.

    After the save, ``written`` maps each file this rank wrote to its manifest entry (size and checksum).
    """

    def __init__(self, path: Path, *, thread_count: int = WRITE_THREADS):
        super().__init__(path, thread_count=thread_count)
        self.written: dict[str, dict[str, Any]] = {}
        self._failures: list[BaseException] = []

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """DCP's write, failing when any writer thread failed or any planned item went unwritten.

        Each thread's failure is kept for this to raise once every thread is done: raised in the calling thread
        alone it would leave the others writing, and torch 2.13's own writer prints an extra thread's failure
        and returns normally, that thread's items missing (the disk fills up): such a save must fail, not be
        marked complete.
        """
        written = super().write_data(plan, planner)
        if self._failures:
            error = self._failures[0]
            raise_if_storage_error(error)
            raise RuntimeError(f"a checkpoint writer thread failed: {error!r}") from error
        results = written.wait()
        if len(results) != len(plan.items):
            raise RuntimeError(f"the checkpoint writer wrote {len(results)} of {len(plan.items)} planned items")
        return written

    def _write_data(self, planner: SavePlanner, file_queue: queue.Queue) -> Future[list[WriteResult]]:
        """Replaces FileSystemWriter's threads (torch 2.13) with ones that write through ``raw_tensors``."""
        results: queue.Queue = queue.Queue()
        threads = [
            threading.Thread(target=self._write_files, args=(file_queue, results, planner), name=f"paratrain-write-{n}")
            for n in range(1, self.thread_count)
        ]
        for thread in threads:
            thread.start()
        self._write_files(file_queue, results, planner)
        for thread in threads:
            thread.join()
        done: Future[list[WriteResult]] = Future()
        done.set_result([result for _ in range(results.qsize()) for result in results.get_nowait()])
        return done

    def _write_files(self, file_queue: queue.Queue, results: queue.Queue, planner: SavePlanner) -> None:
        """One thread's work: whole files off the queue until it is empty or a write fails."""
        try:
            while not file_queue.empty():
                path, name, items = file_queue.get_nowait()
                results.put(self._write_file(Path(path), name, items, planner))
        except queue.Empty:
            pass
        except Exception as error:
            self._failures.append(error)

    def _write_file(self, path: Path, name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        with _ChecksummedFile(path) as stream:
            written = write_items(stream, items, planner, key=name)
            stream.flush()
            if self.sync_files:
                os.fsync(stream.fileno())
        self.written[name] = stream.entry()  # recorded only once the file is written and synced
        return written
