"""DCP reading without unpickling arbitrary objects.

Upstream DCP reads ``.metadata`` with ``pickle.load`` and non-tensor values with
``torch.load(weights_only=False)``: a planted checkpoint could run code. Here the metadata goes
through an unpickler that only builds DCP's own metadata classes and a few torch/builtin types, and
non-tensor values through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from paratrain.errors import CheckpointError

_ALLOWED_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint._extension",
)
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "layout"),
    ("torch", "memory_format"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("torch.serialization", "_get_layout"),  # rebuilds a layout from its name, as weights_only allows
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED_GLOBALS or _is_dtype(module, name):
            return super().find_class(module, name)
        raise CheckpointError(f"refusing to load {module}.{name}: checkpoint metadata may only hold DCP metadata types")


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def load_metadata_safely(data: bytes, *, path: str) -> Metadata:
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError as error:
        raise CheckpointError(f"checkpoint file {path}: {error}") from None
    except Exception as error:  # truncated or garbled pickle: any unpickling failure means corrupt
        raise CheckpointError(f"checkpoint file {path} is corrupt ({type(error).__name__}: {error})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint file {path} holds {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        metadata = load_metadata_safely(self._read_metadata_bytes(path), path=str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _read_metadata_bytes(self, path: Any) -> bytes:
        with self.fs.create_stream(path, "rb") as stream:
            return stream.read()


class SafeLoadPlanner(DefaultLoadPlanner):
    """Loads non-tensor values (ints, floats, lists, dicts) with torch.load(weights_only=True).

    Mirrors DefaultLoadPlanner.load_bytes, which differs only in passing weights_only=False. Equal bytes are
    loaded once: DCP saves the optimizer's param_groups once per parameter (lr, betas, eps, ... each its own
    item), so a model's 1,464 such items held 8 distinct values, and a torch.load each was a fifth of a
    load's time (docs/benchmarks.md, checkpoint I/O round 3).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._loaded: dict[bytes, Any] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = self._load_once(value.getvalue())
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded

    def _load_once(self, data: bytes) -> Any:
        """torch.load of data, the same bytes loaded once (each use gets its own copy: values may be mutable)."""
        if len(data) > _MEMO_LIMIT:
            return torch.load(io.BytesIO(data), weights_only=True)
        if data not in self._loaded:
            self._loaded[data] = torch.load(io.BytesIO(data), weights_only=True)
        return copy.deepcopy(self._loaded[data])


_MEMO_LIMIT = 64 << 10  # larger values are rare and seldom repeated: not kept
