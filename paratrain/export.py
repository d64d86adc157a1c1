"""Consolidated model weights from a checkpoint, as safetensors.

Works from any checkpoint whatever layout wrote it: the model's tensors are read by name through
DCP in this one process (no process group), one tensor at a time.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
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
        dcp.load({key: tensor}, storage_reader=SafeFileSystemReader(checkpoint), planner=SafeLoadPlanner(),
                 no_dist=True)
    return tensor


def export_safetensors(checkpoint: Path, out: Path) -> int:
    """Verifies the checkpoint, then writes its model weights to ``out``; returns the tensor count."""
    manifest = verify_checkpoint(checkpoint)
    names = tensor_names(checkpoint)
    tensors = {name: read_tensor(checkpoint, MODEL_PREFIX + name, item) for name, item in sorted(names.items())}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"step": str(manifest["step"]), "source": str(checkpoint)})
    return len(tensors)
