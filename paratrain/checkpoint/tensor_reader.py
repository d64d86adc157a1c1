"""Whole tensors out of a checkpoint, one at a time, in this one process: what exports read.

An export walks the model's tensors in order, each read whole (its pieces gathered from whichever ranks'
files hold them, whatever layout saved it) and written out before the next is read, so its memory is the
largest tensor's, not the model's. DCP's ``.metadata``, the checkpoint's index, is read and checked once
here, not once per tensor (35 ms a tensor for a 0.58 B-parameter model with its optimizer). Each data file
is checked against the manifest (size and checksum) before the first of its bytes is deserialized, by a
thread that hashes the files ahead in the order the reads will need them, and a file no read needs is
never opened. With the model's entries in files of their own (``file_groups``), an export reads and hashes
the model's files only, and an adapter export the adapters'; a checkpoint written before that split,
model and optimizer entries in the same files, has every file holding a model entry read and checked.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from paratrain.checkpoint.manifest import (
    METADATA_NAME,
    DamagedCheckpointError,
    check_bytes,
    check_size,
    read_manifest,
    verify_file,
)
from paratrain.checkpoint.raw_tensors import RawLayout, is_raw, other_transforms
from paratrain.checkpoint.safe_reader import load_metadata_safely
from paratrain.checkpoint.verifying_reader import RandomAccessStream
from paratrain.errors import CheckpointError


class TensorReader:
    """A checkpoint's tensors by checkpoint key (``model.lm_head.weight``), each read whole.

    Args:
        checkpoint: A complete checkpoint directory.
        verify: Check ``.metadata`` and each file read against the manifest (exports). False reads as DCP
            would, for tests and checks comparing with values a verified load already read.

    Use it in a ``with`` block: it holds open files and the hashing thread.

    Raises (from the constructor, and from ``read`` for the data files):
        CheckpointError: the directory is no complete checkpoint.
        DamagedCheckpointError: naming the first file needed that is missing, unlisted, truncated or altered;
            none of its bytes has been deserialized.
    """

    def __init__(self, checkpoint: Path, *, verify: bool = True):
        self.checkpoint = Path(checkpoint)
        self.manifest: dict[str, Any] = read_manifest(self.checkpoint) if verify else {}
        self._listed: dict[str, dict[str, Any]] | None = self.manifest["files"] if verify else None
        self.metadata: Metadata = self._read_metadata()
        self._layout = RawLayout(self.metadata)
        self.files_read: set[str] = {METADATA_NAME}
        self._checks: dict[str, Future[None]] = {}
        self._hashing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paratrain-export-verify")
        self._open: dict[str, int] = {}

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        self._hashing.shutdown(wait=True, cancel_futures=True)
        for descriptor in self._open.values():
            os.close(descriptor)
        self._open.clear()

    def tensors(self, prefix: str) -> dict[str, TensorStorageMetadata]:
        """The tensors whose keys start with ``prefix``, by full key, sorted."""
        return {
            key: item
            for key, item in sorted(self.metadata.state_dict_metadata.items())
            if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
        }

    def read(self, keys: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, whole tensor) for each of ``keys``, in their order, one read at a time; the files they need
        are checked ahead, in the order they are needed."""
        keys = list(keys)
        self._check_ahead(file for key in keys for file in self._files_of(key))
        for key in keys:
            yield key, self._read_whole(key)

    def read_all(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors of ``keys``, all at once."""
        return dict(self.read(keys))

    def _read_metadata(self) -> Metadata:
        path = self.checkpoint / METADATA_NAME
        if not path.is_file():
            raise DamagedCheckpointError(f"checkpoint file {path} is missing; use an earlier checkpoint")
        data = path.read_bytes()
        if self._listed is not None:
            expected = self._expected(path)
            check_size(path, expected, size=len(data))
            check_bytes(path, memoryview(data), expected)
        return load_metadata_safely(data, path=str(path))

    def _files_of(self, key: str) -> list[str]:
        return [self._stored(key, chunk).relative_path for chunk in self._item(key).chunks]

    def _item(self, key: str) -> TensorStorageMetadata:
        item = self.metadata.state_dict_metadata.get(key)
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {self.checkpoint} holds no tensor {key!r}")
        return item

    def _stored(self, key: str, chunk: ChunkStorageMetadata) -> Any:
        return self.metadata.storage_data[MetadataIndex(key, chunk.offsets)]

    def _check_ahead(self, files: Iterable[str]) -> None:
        if self._listed is None:
            return
        for name in files:
            if name not in self._checks:
                self._checks[name] = self._hashing.submit(self._check_file, name)

    def _check_file(self, name: str) -> None:
        path = self.checkpoint / name
        verify_file(path, self._expected(path))

    def _expected(self, path: Path) -> dict[str, Any]:
        assert self._listed is not None
        expected = self._listed.get(path.name)
        if expected is None:
            raise DamagedCheckpointError(
                f"checkpoint file {path} is not in the checkpoint's manifest; use an earlier checkpoint"
            )
        return expected

    def _read_whole(self, key: str) -> torch.Tensor:
        item = self._item(key)
        if len(item.chunks) == 1 and item.chunks[0].sizes == item.size:
            return self._read_chunk(key, item.chunks[0])  # saved whole: the tensor as loaded, no copy
        whole = torch.empty(item.size, dtype=item.properties.dtype)
        for chunk in item.chunks:  # a tensor sharded when saved: each rank's piece into its place
            region = tuple(slice(offset, offset + size) for offset, size in zip(chunk.offsets, chunk.sizes))
            whole[region] = self._read_chunk(key, chunk)
        return whole

    def _read_chunk(self, key: str, chunk: ChunkStorageMetadata) -> torch.Tensor:
        stored = self._stored(key, chunk)
        if other_transforms(stored):
            raise CheckpointError(
                f"checkpoint {self.checkpoint}: {key} was saved through DCP stream transforms "
                f"({', '.join(other_transforms(stored))}), which paratrain's writer never uses; read it with DCP"
            )
        self._check_ahead([stored.relative_path])
        if self._listed is not None:
            self._checks[stored.relative_path].result()  # a damaged file raises here, before any of it is read
        path = self.checkpoint / stored.relative_path
        if stored.relative_path not in self._open:
            self._open[stored.relative_path] = os.open(path, os.O_RDONLY)
        self.files_read.add(stored.relative_path)
        record = _FileSlice(self._open[stored.relative_path], stored.offset, stored.length, path=path)
        if is_raw(stored):  # read straight into the tensor's memory
            into = bytearray(stored.length)
            record.readinto(into)
            return self._layout.tensor(MetadataIndex(key, chunk.offsets), memoryview(into), where=str(path))
        return torch.load(record, map_location="cpu", weights_only=True)


class _FileSlice(RandomAccessStream):
    """``size`` bytes of an open file from ``offset``, read with pread (no shared file position)."""

    def __init__(self, descriptor: int, offset: int, size: int, *, path: Path):
        super().__init__(size)
        self._descriptor, self._offset, self._path = descriptor, offset, path

    def _read_at(self, position: int, target: memoryview) -> None:
        while len(target):
            count = os.preadv(self._descriptor, [target], self._offset + position)
            if count == 0:
                raise DamagedCheckpointError(
                    f"checkpoint file {self._path} was truncated while it was read; use an earlier checkpoint"
                )
            target, position = target[count:], position + count
