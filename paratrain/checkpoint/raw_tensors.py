"""Plain tensors stored as their raw bytes inside DCP's files, instead of one ``torch.save`` archive each.

DCP's file writer wraps every tensor in a ``torch.save`` zip archive and its reader opens each with
``torch.load``: per item a pickle, a zip directory and a storage allocation. A resume of 1,996 items spent
0.5 s of a 0.59 s read there (docs/benchmarks.md, checkpoint I/O). Here a dense tensor is written as its bytes,
C-contiguous, at a 64-byte aligned offset of its file, and read back by viewing those bytes as a tensor (no
parser at all) and copying them into the state. Its dtype and shape are DCP's own metadata for the piece
(``TensorStorageMetadata``), its place in the file DCP's ``_StorageInfo``, whose ``transform_descriptors``
carry ``RAW``: torch's own ``FileSystemReader`` refuses such an item (``Unknown extension``) instead of
misreading it. Anything else (non-tensor values, sparse or quantized tensors) is written as DCP writes it and
read through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from paratrain.errors import CheckpointError

RAW = "paratrain.raw_tensor/1"  # DCP's "name/version" form of a transform descriptor
_ALIGN = 64  # every dtype's alignment, and a cache line: a view of the bytes needs no copy to be read


def write_items(
    stream: io.BufferedIOBase, items: list[WriteItem], planner: SavePlanner, *, key: str
) -> list[WriteResult]:
    """Writes ``items`` into ``stream`` (a file named ``key`` in ``.metadata``): values first, then tensors,
    largest-first order kept as DCP's split left it; returns DCP's record of where each went."""
    values = [item for item in items if item.type == WriteItemType.BYTE_IO]
    tensors = [item for item in items if item.type != WriteItemType.BYTE_IO]
    results = [_write_value(stream, item, planner.resolve_data(item), key=key) for item in values]
    for item in tensors:
        tensor = planner.resolve_data(item).detach().cpu()
        write = _write_raw if is_plain(tensor) else _write_archive
        results.append(write(stream, item, tensor, key=key))
    return results


def is_plain(tensor: torch.Tensor) -> bool:
    """Whether the tensor is stored raw: dense, not quantized, not a tensor subclass's wrapper."""
    return tensor.layout == torch.strided and not tensor.is_quantized and type(tensor) is torch.Tensor


def _write_value(stream: io.BufferedIOBase, item: WriteItem, data: io.BytesIO, *, key: str) -> WriteResult:
    offset = stream.tell()
    stream.write(data.getbuffer())
    return _result(item, key, offset, stream.tell() - offset)


def _write_archive(stream: io.BufferedIOBase, item: WriteItem, tensor: torch.Tensor, *, key: str) -> WriteResult:
    """As DCP writes a tensor: read back by ``torch.load``."""
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()  # torch.save writes the whole storage of a view
    offset = stream.tell()
    torch.save(tensor, stream)
    return _result(item, key, offset, stream.tell() - offset)


def _write_raw(stream: io.BufferedIOBase, item: WriteItem, tensor: torch.Tensor, *, key: str) -> WriteResult:
    stream.write(bytes(-stream.tell() % _ALIGN))
    offset = stream.tell()
    stream.write(_bytes_of(tensor.resolve_conj().resolve_neg().contiguous()))
    return _result(item, key, offset, stream.tell() - offset, raw=True)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy (numpy has no bfloat16, so viewed as bytes first)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _result(item: WriteItem, key: str, offset: int, length: int, *, raw: bool = False) -> WriteResult:
    stored = _StorageInfo(key, offset, length, transform_descriptors=[RAW] if raw else None)
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=stored)


def is_raw(stored: Any) -> bool:
    """Whether the item DCP's ``_StorageInfo`` describes was written raw."""
    return RAW in (stored.transform_descriptors or ())


def other_transforms(stored: Any) -> list[str]:
    """The item's transform descriptors other than ``RAW``: DCP stream transforms, which paratrain never writes."""
    return [descriptor for descriptor in stored.transform_descriptors or () if descriptor != RAW]


class RawLayout:
    """The dtype and shape of each stored piece of a checkpoint's tensors, from its ``.metadata``, to view raw
    bytes as the tensor they were."""

    def __init__(self, metadata: Metadata):
        self._pieces: dict[MetadataIndex, tuple[torch.Size, torch.dtype]] = {
            MetadataIndex(fqn, chunk.offsets): (chunk.sizes, item.properties.dtype)
            for fqn, item in metadata.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata)
            for chunk in item.chunks
        }

    def tensor(self, index: MetadataIndex, data: memoryview, *, where: str) -> torch.Tensor:
        """The stored piece ``index`` over ``data``, its raw bytes (writable, so torch takes them as they are; the
        tensor shares them and is only ever copied from).

        Raises:
            CheckpointError: ``.metadata`` holds no such piece, or one of another size than ``data``: the
                checkpoint's index and its files disagree (``where`` names the file).
        """
        sizes, dtype = self._piece(index, where=where)
        expected = sizes.numel() * dtype.itemsize
        if len(data) != expected:
            raise CheckpointError(
                f"checkpoint file {where}: {index.fqn} holds {len(data)} bytes where its metadata says {expected}; "
                "use an earlier checkpoint"
            )
        if expected == 0:
            return torch.empty(sizes, dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).view(sizes)

    def _piece(self, index: MetadataIndex, *, where: str) -> tuple[torch.Size, torch.dtype]:
        piece = self._pieces.get(MetadataIndex(index.fqn, index.offset))
        if piece is None:
            raise CheckpointError(
                f"checkpoint file {where}: .metadata describes no stored piece {index}; use an earlier checkpoint"
            )
        return piece
