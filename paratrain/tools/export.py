"""Consolidated model weights from a checkpoint, as safetensors.

Works from any checkpoint whatever layout wrote it: the model's tensors are read by name in this one
process (no process group), one whole tensor at a time (checkpoint.tensor_reader: DCP's ``.metadata``
read once, each file checked against the manifest before its first tensor is read, only the model's files
read), and streamed into the file, so exporting needs memory for the largest tensor, not the model. The
safetensors library writes only from a dict of every tensor in memory; the format (an 8-byte header
length, a JSON header of names, dtypes, shapes and byte offsets, then the raw bytes) is simple enough to
stream, and the tests read the result back with the library.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import struct
from collections.abc import Iterator
from operator import itemgetter
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from paratrain.checkpoint.manifest import DamagedCheckpointError
from paratrain.checkpoint.selection import choose_resume, previous_loadable
from paratrain.checkpoint.state import MODEL_PREFIX
from paratrain.checkpoint.tensor_reader import TensorReader
from paratrain.config.factories import call_factory
from paratrain.config.schema import LoraConfig, ModelConfig
from paratrain.errors import ConfigError
from paratrain.models.expert_files import DEFAULT_STYLE, FILE_STYLE, per_expert_names, split_stacked
from paratrain.models.hf import is_transformers_model
from paratrain.models.hf_experts import DISPATCHED
from paratrain.models.meta import on_meta
from paratrain.tools.export_lora import export_adapter, merged_model

logger = logging.getLogger(__name__)


def export_safetensors(checkpoint: Path, out: Path) -> int:
    """Writes the checkpoint's model weights to ``out``, each file read checked against the manifest;
    returns the tensor count."""
    with TensorReader(checkpoint) as reader:
        items = reader.tensors(MODEL_PREFIX)
        metadata = {"step": str(reader.manifest["step"]), "source": str(checkpoint)}
        _write_safetensors(out, _without_prefix(items), _tensors_of(reader, items), metadata=metadata)
    return len(items)


def export_newest_hf(checkpoints: Path, out_dir: Path) -> tuple[Path, int] | None:
    """The newest complete checkpoint in ``checkpoints`` as a Hugging Face directory (``export_hf``), as a
    finished run's ``checkpoint.save_final_hf`` writes it: (that checkpoint, tensors written), or None when
    the directory holds none. One the export finds a damaged file in is skipped, loudly, for the one before.

    Raises:
        CheckpointError: checkpoints exist but none exports (starting over would hide that).
    """
    checkpoint = choose_resume(checkpoints, "auto", rank=0)
    while checkpoint is not None:
        try:
            return checkpoint, export_hf(checkpoint, out_dir)
        except DamagedCheckpointError as error:
            logger.warning("skipping damaged checkpoint: %s; falling back to the previous one", error)
            checkpoint = previous_loadable(checkpoints, checkpoint, rank=0)
    return None


def export_hf(checkpoint: Path, out_dir: Path, *, max_shard_bytes: int = 2 << 30, merge: bool = False) -> int:
    """Writes a Hugging Face model directory (config.json, safetensors shards of at most
    ``max_shard_bytes`` and model.safetensors.index.json) from a checkpoint of a transformers model,
    streaming one tensor at a time; ``from_pretrained(out_dir)`` loads it. Returns the tensor count.
    A LoRA run's checkpoint is written as a peft adapter directory instead (its adapter tensors alone
    read), or with ``merge`` as the model with its adapter merged in, streamed and sharded the same way
    (tools.export_lora).

    Raises:
        ConfigError: when the checkpoint's model is not a transformers model, or ``merge`` without LoRA.
        DamagedCheckpointError: naming a file read that does not match the manifest.
    """
    with TensorReader(checkpoint) as reader:
        model_section = reader.manifest["config"]["model"]
        model = _model_on_meta(model_section)
        if model_section.get("lora") is not None and not merge:
            lora = LoraConfig(**model_section["lora"])
            return export_adapter(reader, lora, out_dir, base=model_section.get("pretrained"))
        entries, tensors = _experts_as_saved(model, *_hf_tensors(reader, checkpoint, model_section, merge=merge))
        metadata = {"format": "pt", "step": str(reader.manifest["step"])}
        written = _write_hf_shards(out_dir, entries, tensors, max_shard_bytes, metadata=metadata)
    model.config.save_pretrained(out_dir)  # last: a directory with config.json is a finished export
    return written


def _hf_tensors(
    reader: TensorReader, checkpoint: Path, model_section: dict, *, merge: bool
) -> tuple[dict[str, TensorStorageMetadata], Iterator[torch.Tensor]]:
    """What an --hf export writes, by name and in order: the model's tensors, or (``merge``) its base model's
    with the LoRA adapter merged in."""
    if not merge:
        items = reader.tensors(MODEL_PREFIX)
        return _without_prefix(items), _tensors_of(reader, items)
    if model_section.get("lora") is None:
        raise ConfigError(
            f"export --merge: {checkpoint} is a full fine-tune's checkpoint, with no LoRA adapter to merge; "
            f"export it with --hf alone"
        )
    return merged_model(reader, LoraConfig(**model_section["lora"]))


def _experts_as_saved(
    model, entries: dict[str, TensorStorageMetadata], tensors: Iterator[torch.Tensor]
) -> tuple[dict[str, TensorStorageMetadata], Iterator[torch.Tensor]]:
    """``entries`` and ``tensors`` with a transformers family's stacked experts cut into one tensor per expert and
    projection, as its save_pretrained writes them (models/expert_files.py); unchanged for other models."""
    if not any(type(module).__name__ in DISPATCHED for module in model.modules()):
        return entries, tensors
    style = FILE_STYLE.get(type(model).__name__, DEFAULT_STYLE)
    plans = {
        name: per_expert_names(name, num_experts=item.size[0], style=style) if len(item.size) == 3 else None
        for name, item in entries.items()
    }
    cut = {}
    for name, item in entries.items():
        for parts in plans[name] or [[name]]:
            rows = item.size[1] // len(parts) if plans[name] else None
            for part in parts:
                cut[part] = dataclasses.replace(item, size=torch.Size([rows, *item.size[2:]])) if rows else item

    def stream() -> Iterator[torch.Tensor]:
        for name, tensor in zip(entries, tensors):
            yield from (piece for _, piece in split_stacked(plans[name], tensor)) if plans[name] else (tensor,)

    return cut, stream()


def _write_hf_shards(
    out_dir: Path,
    entries: dict[str, TensorStorageMetadata],
    tensors: Iterator[torch.Tensor],
    max_shard_bytes: int,
    *,
    metadata: dict[str, str],
) -> int:
    """Writes ``tensors`` (in the order of ``entries``, by the names and shapes it gives) as safetensors
    shards of at most ``max_shard_bytes`` and the index transformers reads them by; returns the count."""
    shards = _split_into_shards(entries, max_shard_bytes)
    out_dir.mkdir(parents=True, exist_ok=True)
    # transformers loads model.safetensors before any index: one left by an earlier unsharded export into this
    # directory (--merge wrote one) would shadow this export
    (out_dir / "model.safetensors").unlink(missing_ok=True)
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(out_dir / file, shard, tensors, metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(map(_nbytes, entries.values()))}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return len(entries)


def _without_prefix(items: dict[str, TensorStorageMetadata]) -> dict[str, TensorStorageMetadata]:
    return {key.removeprefix(MODEL_PREFIX): item for key, item in items.items()}


def _tensors_of(reader: TensorReader, items: dict[str, TensorStorageMetadata]) -> Iterator[torch.Tensor]:
    # map, not a generator expression: that would keep the last tensor bound while it reads the next
    return map(itemgetter(1), reader.read(items))


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
        if shards[-1] and size + _nbytes(item) > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = item
        size += _nbytes(item)
    return shards


def _nbytes(item: TensorStorageMetadata) -> int:
    return math.prod(item.size) * item.properties.dtype.itemsize


def _write_safetensors(
    out: Path, names: dict[str, TensorStorageMetadata], tensors: Iterator[torch.Tensor], *, metadata: dict[str, str]
) -> None:
    """Writes the next ``len(names)`` of ``tensors`` to ``out``, under ``names``, one tensor in memory at a time."""
    header = _safetensors_header(names, metadata=metadata)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(struct.pack("<Q", len(header)) + header)
            for name, item in names.items():
                tensor = next(tensors)
                assert tensor.shape == item.size and tensor.dtype == item.properties.dtype, name
                handle.write(tensor.contiguous().view(-1).view(torch.uint8).numpy())  # the bytes, not a copy
                del tensor  # let go before the next is read: one tensor in memory, not two
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
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
        size = _nbytes(item)
        entries[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(item.size),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % 8)  # the byte buffer starts 8-byte aligned
