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

from paratrain.checkpoint.checkpointer import Checkpointer
from paratrain.checkpoint.manifest import verify_checkpoint
from paratrain.checkpoint.safe_reader import SafeFileSystemReader, SafeLoadPlanner
from paratrain.config.factories import call_factory
from paratrain.config.schema import LoraConfig, ModelConfig
from paratrain.errors import ConfigError
from paratrain.models.hf import is_transformers_model
from paratrain.models.meta import on_meta
from paratrain.parallel.collectives import quiet_single_process

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


def read_tensors(
    checkpoint: Path, items: dict[str, TensorStorageMetadata], *, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """Several whole tensors by full checkpoint key, in one read (one per tensor re-plans the whole
    checkpoint each time); returned keyed without ``prefix``."""
    tensors = {key: torch.empty(item.size, dtype=item.properties.dtype) for key, item in items.items()}
    with quiet_single_process():
        dcp.load(tensors, storage_reader=SafeFileSystemReader(checkpoint), planner=SafeLoadPlanner(), no_dist=True)
    return {key.removeprefix(prefix): tensor for key, tensor in tensors.items()}


def export_safetensors(checkpoint: Path, out: Path) -> int:
    """Verifies the checkpoint, then writes its model weights to ``out``; returns the tensor count."""
    manifest = verify_checkpoint(checkpoint)
    names = dict(sorted(tensor_names(checkpoint).items()))
    _write_safetensors(checkpoint, names, out, metadata={"step": str(manifest["step"]), "source": str(checkpoint)})
    return len(names)


def export_newest_hf(checkpoints: Path, out_dir: Path) -> tuple[Path, int] | None:
    """The newest verified checkpoint in ``checkpoints`` as a Hugging Face directory (``export_hf``), as a
    finished run's ``checkpoint.save_final_hf`` writes it: (that checkpoint, tensors written), or None
    when the directory holds none."""
    latest = Checkpointer(checkpoints, keep_last=None, rank=0, world_size=1, config={}).latest_verified()
    if latest is None:
        return None
    return latest, export_hf(latest, out_dir)


def export_hf(checkpoint: Path, out_dir: Path, *, max_shard_bytes: int = 2 << 30, merge: bool = False) -> int:
    """Writes a Hugging Face model directory (config.json, safetensors shards of at most
    ``max_shard_bytes`` and model.safetensors.index.json) from a checkpoint of a transformers model,
    streaming one tensor at a time; ``from_pretrained(out_dir)`` loads it. Returns the tensor count.
    A LoRA run's checkpoint is written as a peft adapter directory instead, or with ``merge`` as the
    model with its adapter merged in (tools.export_lora).

    Raises:
        ConfigError: when the checkpoint's model is not a transformers model, or ``merge`` without LoRA.
    """
    manifest = verify_checkpoint(checkpoint)
    model = _model_on_meta(manifest["config"]["model"])
    lora = manifest["config"]["model"].get("lora")
    if lora is not None or merge:
        return _export_lora(checkpoint, out_dir, manifest["config"]["model"], model, merge=merge)
    names = dict(sorted(tensor_names(checkpoint).items()))
    shards = _split_into_shards(names, max_shard_bytes)
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map, metadata = {}, {"format": "pt", "step": str(manifest["step"])}
    for number, shard in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(checkpoint, shard, out_dir / file, metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(math.prod(item.size) * item.properties.dtype.itemsize for item in names.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    model.config.save_pretrained(out_dir)  # last: a directory with config.json is a finished export
    return len(names)


def _export_lora(checkpoint: Path, out_dir: Path, model_section: dict, model, *, merge: bool) -> int:
    from paratrain.tools.export_lora import export_adapter, merged_tensors  # Lazy: peft, only for LoRA runs

    if model_section.get("lora") is None:
        raise ConfigError(
            f"export --merge: {checkpoint} is a full fine-tune's checkpoint, with no LoRA adapter to merge; "
            f"export it with --hf alone"
        )
    lora = LoraConfig(**model_section["lora"])
    names = {MODEL_PREFIX + name: item for name, item in tensor_names(checkpoint).items()}
    tensors = read_tensors(checkpoint, names, prefix=MODEL_PREFIX)
    if not merge:
        return export_adapter(tensors, lora, out_dir, base=model_section.get("pretrained"))
    from safetensors.torch import save_file  # Lazy: safetensors only for exports

    merged = merged_tensors(tensors, lora)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(merged, out_dir / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(out_dir)  # last: a directory with config.json is a finished export
    return len(merged)


def _model_on_meta(model_section: dict):

    with on_meta():
        model = call_factory(ModelConfig(**model_section), key="model")
    if not is_transformers_model(model):
        raise ConfigError(
            f"export --hf: the checkpoint's model ({type(model).__name__} from {model_section['factory']}) is not "
            f"a transformers model; export its weights with --out FILE.safetensors instead"
        )
    return model


def _split_into_shards(names: dict[str, TensorStorageMetadata], max_bytes: int) -> list[dict]:
    shards: list[dict] = [{}]
    size = 0
    for name, item in names.items():
        nbytes = math.prod(item.size) * item.properties.dtype.itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = item
        size += nbytes
    return shards


def _write_safetensors(
    checkpoint: Path, names: dict[str, TensorStorageMetadata], out: Path, *, metadata: dict[str, str]
) -> None:
    header = _safetensors_header(names, metadata=metadata)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        for name, item in names.items():
            tensor = read_tensor(checkpoint, MODEL_PREFIX + name, item)
            handle.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    tmp.replace(out)  # a crash mid-export never leaves a truncated file under the final name


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
