"""DCP reading that checks each checkpoint file against the manifest as it reads it: one pass over the
bytes instead of two.

A resume used to hash every file (``verify_checkpoint``) and then have DCP read them all again, in
small reads, one item at a time. Here each file a rank needs is read whole, sequentially, in large
reads, and hashed as it streams in; only once its size and SHA-256 match the manifest are DCP's read
items cut from those bytes and deserialized into the state. So no byte of a damaged file ever reaches
the state, nor any parser (the torch.load of each item, weights_only as everywhere). The next file is
read and hashed in a thread while the current one is served: hashlib and file reads release the GIL.

Memory: at most ``READ_AHEAD`` whole files per rank at once. A file is one writer thread's share of
one rank's state at save time (``hashing.WRITE_THREADS`` per rank), so about half of a rank's shard.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from paratrain.checkpoint.manifest import DamagedCheckpointError, check_sha256, check_size
from paratrain.checkpoint.safe_reader import SafeFileSystemReader

READ_CHUNK = 8 << 20  # large sequential reads: a cold file streams at the disk's rate
READ_AHEAD = 2  # files in memory at once: the one being served, the next being read and hashed


class VerifyingReader(SafeFileSystemReader):
    """SafeFileSystemReader that serves DCP's reads only from files whose size and SHA-256 match the manifest.

    Args:
        path: The checkpoint directory.
        listed: The manifest's ``files``: name -> ``{"bytes", "sha256"}``.

    After a load, ``verified`` holds the names of the files this rank read (and so checked), ``.metadata``
    included; files no rank read are left to the caller to check (``Checkpointer.load``).

    Raises (from ``read_metadata`` and ``read_data``, which DCP gathers onto every rank):
        DamagedCheckpointError: naming the first file that is missing, unlisted, truncated or altered.
    """

    def __init__(self, path: Path, *, listed: dict[str, dict[str, Any]]):
        super().__init__(path)
        self.listed = listed
        self.verified: set[str] = set()

    def _read_metadata_bytes(self, path: Any) -> bytes:
        data = super()._read_metadata_bytes(path)
        expected = self._expected(Path(path))
        check_size(Path(path), expected, size=len(data))
        check_sha256(Path(path), hashlib.sha256(data).hexdigest(), expected)
        self.verified.add(Path(path).name)
        return data

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Serves each file's read items once the whole file has checked out (replaces FileSystemReader's
        per-item reads, torch 2.13, whose deserialization it mirrors in ``_serve``)."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        names = iter(sorted(per_file))  # every rank checks in the same order: the same bad file is named first
        with ThreadPoolExecutor(max_workers=READ_AHEAD, thread_name_prefix="paratrain-verify-read") as pool:
            reading = deque((name, pool.submit(self._read_verified, name)) for name in islice(names, READ_AHEAD))
            while reading:
                name, future = reading.popleft()
                data = future.result()  # a damaged file raises here, before any of its items is served
                self._serve(per_file[name], memoryview(data), planner)
                del data  # freed before the next file is read: at most READ_AHEAD files in memory
                reading.extend((name, pool.submit(self._read_verified, name)) for name in islice(names, 1))
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self.verified = set()

    def _expected(self, path: Path) -> dict[str, Any]:
        expected = self.listed.get(path.name)
        if expected is None:
            raise DamagedCheckpointError(
                f"checkpoint file {path} is not in the checkpoint's manifest; use an earlier checkpoint"
            )
        return expected

    def _read_verified(self, name: str) -> bytearray:
        path = Path(self.fs.concat_path(self.path, name))
        expected = self._expected(path)
        check_size(path, expected)  # a truncated file is named before it is read
        data, sha256 = read_hashed(path, expected["bytes"])
        check_size(path, expected, size=len(data))  # truncated while being read
        check_sha256(path, sha256, expected)
        self.verified.add(name)
        return data

    def _serve(self, items: list[ReadItem], data: memoryview, planner: LoadPlanner) -> None:
        for item in items:
            stored = self.storage_data[item.storage_index]
            raw = io.BytesIO(data[stored.offset : stored.offset + stored.length])
            stream = self.transforms.transform_load_stream(item, stored.transform_descriptors or (), raw)
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(stream.read(-1)))
            else:
                _copy_tensor(item, stream, planner)


def _copy_tensor(item: ReadItem, stream: Any, planner: LoadPlanner) -> None:
    """As torch's FileSystemReader.read_data does for one tensor item."""
    seekable = stream if stream.seekable() else io.BytesIO(stream.read(-1))  # torch.load needs to seek
    tensor = torch.load(seekable, map_location="cpu", weights_only=True)
    tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise AssertionError(f"req {item.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
    target.copy_(tensor)
    planner.commit_tensor(item, target)


def read_hashed(path: Path, size: int) -> tuple[bytearray, str]:
    """At most ``size`` bytes of the file, read sequentially in large reads, and their SHA-256."""
    data = bytearray(size)
    view = memoryview(data)
    digest = hashlib.sha256()
    filled = 0
    with open(path, "rb", buffering=0) as handle:
        if hasattr(os, "posix_fadvise"):  # Linux: a larger read-ahead window
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while filled < size and (count := handle.readinto(view[filled : filled + READ_CHUNK])):
            digest.update(view[filled : filled + count])  # releases the GIL, as the read does
            filled += count
    del view  # a bytearray with a view exported cannot be resized
    del data[filled:]
    return data, digest.hexdigest()
