"""Consolidated model weights from a checkpoint, as safetensors.

Works from any checkpoint whatever layout wrote it: the model's tensors are read by name through
DCP in this one process (no process group), one full tensor at a time, and streamed into the file,
so exporting needs memory for the largest tensor, not the model. The safetensors library writes
only from a dict of every tensor in memory; the format (an 8-byte header length, a JSON header of
names, dtypes, shapes and byte offsets, then the raw bytes) is simple enough to stream, and the
tests read the result back with the library.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from paratrain.checkpoint.checkpointer import quiet_single_process
from paratrain.checkpoint.manifest import verify_checkpoint
from paratrain.checkpoint.safe_reader import SafeFileSystemReader, SafeLoadPlanner

MODEL_PREFIX = "model."


def tensor_names(checkpoint: Path, prefix: str = MODEL_PREFIX) -> dict[str, TensorStorageMetadata]:
    """Checkpoint keys of the tensors under ``prefix`` (returned without it) and their metadata."""
    metadata = SafeFileSystemReader(checkpoint).read_metadata()
    return {
        key.removeprefix(prefix): item
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }


def read_tensor(checkpoint: Path, key: str, item: TensorStorageMetadata) -> torch.Tensor:
    """One whole tensor, by its full checkpoint key, assembled from however many shards hold it."""
    tensor = torch.empty(item.size, dtype=item.properties.dtype)
    with quiet_single_process():
        dcp.load(
            {key: tensor}, storage_reader=SafeFileSystemReader(checkpoint), planner=SafeLoadPlanner(), no_dist=True
        )
    return tensor


def export_safetensors(checkpoint: Path, out: Path) -> int:
    """Verifies the checkpoint, then writes its model weights to ``out``; returns the tensor count."""
    manifest = verify_checkpoint(checkpoint)
    names = dict(sorted(tensor_names(checkpoint).items()))
    header = _safetensors_header(names, metadata={"step": str(manifest["step"]), "source": str(checkpoint)})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        for name, item in names.items():
            tensor = read_tensor(checkpoint, MODEL_PREFIX + name, item)
            handle.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    tmp.replace(out)  # a crash mid-export never leaves a truncated file under the final name
    return len(names)


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _safetensors_header(names: dict[str, TensorStorageMetadata], *, metadata: dict[str, str]) -> bytes:
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, item in names.items():
        dtype = item.properties.dtype
        size = math.prod(item.size) * dtype.itemsize
        entries[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(item.size),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % 8)  # the byte buffer starts 8-byte aligned
