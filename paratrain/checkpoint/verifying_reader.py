"""DCP reading that checks each checkpoint file against the manifest as it reads it: one pass over the
bytes instead of two.

A resume used to hash every file (``verify_checkpoint``) and then have DCP read them all again, in
small reads, one item at a time. Here each file a rank needs is mapped whole and hashed in one
sequential pass; only once its size and checksum match the manifest are DCP's read items cut from those
bytes and copied into the state: a raw tensor (``raw_tensors``) viewed in place, anything else through
``torch.load(weights_only=True)`` as everywhere. So no byte of a damaged file ever reaches the state, nor any
parser. The next file is hashed in a thread while the current one is served: hashing releases the GIL.

Memory: files are mapped, not copied (see ``map_file``): at most ``READ_AHEAD`` per rank at once, their
pages the page cache's. A file is one writer thread's share of one group of a rank's entries at save time
(``hashing.WRITE_THREADS`` per group; the model's weights, a LoRA run's adapters, the rest: ``file_groups``),
so at most about half of a rank's shard.
"""

from __future__ import annotations

import io
import mmap
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from paratrain.checkpoint.manifest import DamagedCheckpointError, check_bytes, check_size
from paratrain.checkpoint.raw_tensors import RawLayout, is_raw
from paratrain.checkpoint.safe_reader import SafeFileSystemReader

# Files mapped at once: the one being served, and the next, hashed meanwhile by one thread. One thread, not
# one per file: hashing the next file beside the (GIL-bound) deserializing of this one keeps both cores busy,
# where hashing two files at once left the deserializing to wait for both (0.63 s against 0.76 s predicted
# for a 0.48 GB load on two cores, docs/benchmarks.md).
READ_AHEAD = 2


class VerifyingReader(SafeFileSystemReader):
    """SafeFileSystemReader that serves DCP's reads only from files whose size and checksum match the manifest.

    Args:
        path: The checkpoint directory.
        listed: The manifest's ``files``: name -> ``{"bytes", <algorithm>}`` (``checksums``).

    After a load, ``verified`` holds the names of the files this rank read (and so checked), ``.metadata``
    included; files no rank read are left to the caller to check (``Checkpointer.load``).

    Raises (from ``read_metadata`` and ``read_data``, which DCP gathers onto every rank):
        DamagedCheckpointError: naming the first file that is missing, unlisted, truncated or altered.
    """

    def __init__(self, path: Path, *, listed: dict[str, dict[str, Any]]):
        super().__init__(path)
        self.listed = listed
        self.verified: set[str] = set()
        self._layout: RawLayout | None = None
        self._metadata: dict[Any, Metadata] = {}

    def _read_metadata_bytes(self, path: Any) -> bytes:
        data = super()._read_metadata_bytes(path)
        expected = self._expected(Path(path))
        check_size(Path(path), expected, size=len(data))
        check_bytes(Path(path), memoryview(data), expected)
        self.verified.add(Path(path).name)
        return data

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checked ``.metadata``, read and unpickled once however often it is asked for (the caller's look
        before the load, then DCP's own): a tenth of a second of CPU a time for 2,000 entries."""
        rank = kwargs.get("rank")
        if rank not in self._metadata:
            self._metadata[rank] = super().read_metadata(*args, **kwargs)
        return self._metadata[rank]

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._layout = RawLayout(metadata)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Serves each file's read items once the whole file has checked out (replaces FileSystemReader's
        per-item reads, torch 2.13, whose deserialization it mirrors in ``_serve``)."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        names = iter(sorted(per_file))  # every rank checks in the same order: the same bad file is named first
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="paratrain-verify-read") as pool:
            reading = deque((name, pool.submit(self._read_verified, name)) for name in islice(names, READ_AHEAD))
            while reading:
                name, future = reading.popleft()
                # A damaged file raises in result(), before any of its items is served.
                self._serve(per_file[name], future.result(), planner)
                del future  # it holds the mapping: unmapped before the next is mapped, READ_AHEAD at most
                reading.extend((name, pool.submit(self._read_verified, name)) for name in islice(names, 1))
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self.verified, self._metadata = set(), {}

    def _expected(self, path: Path) -> dict[str, Any]:
        expected = self.listed.get(path.name)
        if expected is None:
            raise DamagedCheckpointError(
                f"checkpoint file {path} is not in the checkpoint's manifest; use an earlier checkpoint"
            )
        return expected

    def _read_verified(self, name: str) -> memoryview:
        path = Path(self.fs.concat_path(self.path, name))
        expected = self._expected(path)
        check_size(path, expected)  # a truncated file is named before it is mapped
        data = map_file(path)
        check_size(path, expected, size=len(data))  # changed between the two looks
        check_bytes(path, data, expected)
        self.verified.add(name)
        return data

    def _serve(self, items: list[ReadItem], data: memoryview, planner: LoadPlanner) -> None:
        for item in items:
            stored = self.storage_data[item.storage_index]
            piece = data[stored.offset : stored.offset + stored.length]
            if is_raw(stored):
                assert self._layout is not None  # DCP sets the reader up before any read
                where = str(Path(self.fs.concat_path(self.path, stored.relative_path)))
                _copy_into(item, self._layout.tensor(item.storage_index, piece, where=where), planner)
                continue
            stream = self.transforms.transform_load_stream(item, stored.transform_descriptors or (), _ViewStream(piece))
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(stream.read(-1)))
            else:
                seekable = stream if stream.seekable() else io.BytesIO(stream.read(-1))  # torch.load needs to seek
                _copy_into(item, torch.load(seekable, map_location="cpu", weights_only=True), planner)


class RandomAccessStream(io.RawIOBase):
    """A read-only, seekable stream of ``size`` bytes that torch.load reads a tensor's record from straight into
    the tensor's storage (through ``readinto``), with no copy of the whole record first: each read is served by
    ``_read_at``."""

    def __init__(self, size: int):
        super().__init__()
        self._size = size
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(0, start + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), self._size - self._position))
        self._read_at(self._position, memoryview(buffer).cast("B")[:count])
        self._position += count
        return count

    def _read_at(self, position: int, target: memoryview) -> None:
        raise NotImplementedError


class _ViewStream(RandomAccessStream):
    """Bytes already in memory, read without copying them (io.BytesIO would first copy the item)."""

    def __init__(self, view: memoryview):
        super().__init__(len(view))
        self._view = view

    def _read_at(self, position: int, target: memoryview) -> None:
        target[:] = self._view[position : position + len(target)]


def _copy_into(item: ReadItem, stored: torch.Tensor, planner: LoadPlanner) -> None:
    """As torch's FileSystemReader.read_data does with one tensor item once it is loaded: the part the item
    reads, into the state's tensor."""
    tensor = narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise AssertionError(f"req {item.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
    target.copy_(tensor)
    planner.commit_tensor(item, target)


def map_file(path: Path) -> memoryview:
    """The file's bytes, mapped copy-on-write (never written: writable only so that torch views raw tensors in
    them as they are).

    Mapped, not read into a buffer: the bytes are the page cache's own, so neither a copy nor a fresh
    allocation's page faults (which made a read-into-memory pass over a 0.24 GB file 0.37-0.64 s against
    0.15 s mapped, docs/benchmarks.md). What is served is what was hashed as long as nothing writes the
    file during the load; a checkpoint being rewritten under a resume is outside what this guards against
    (the separate verify pass it replaces left a wider window), and a file truncated while mapped stops the
    process with SIGBUS rather than an error.
    """
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return memoryview(b"")
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    if hasattr(mapped, "madvise"):  # Linux: a larger read-ahead window while hashing
        mapped.madvise(mmap.MADV_SEQUENTIAL)
    return memoryview(mapped)
