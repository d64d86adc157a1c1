"""Pretrained weights from a directory of safetensors files (a Hugging Face model directory, or what
``paratrain export --hf`` writes), read one tensor at a time by name.

A sharded parameter (plain Shard/Replicate placements: fsdp, hsdp, tp) is read as this rank's slice
alone (safetensors ``get_slice``), so each rank reads and holds only its share of the files. Other
tensors are read whole, and each rank keeps its slice and drops the rest (``models.init.materialize``),
so loading holds this rank's shards plus at most one full tensor, never the whole model.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.errors import ConfigError
from paratrain.models.expert_files import find_per_expert_names, read_stacked
from paratrain.models.init_replay import box_of
from paratrain.models.lora import base_name, is_adapter
from paratrain.models.weights import LocalPiece, canonical_name

logger = logging.getLogger("paratrain")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def weight_files(directory: Path) -> dict[str, Path]:
    """Which file holds each tensor: from the index of a sharded directory, else from the headers of
    its ``*.safetensors`` files.

    Raises:
        ConfigError: naming model.pretrained when the directory holds no safetensors weights.
    """
    index = directory / INDEX_FILE
    if index.is_file():
        return {name: directory / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"model.pretrained={str(directory)!r} holds no {SINGLE_FILE} or {INDEX_FILE}; point it at a "
            f"directory written by save_pretrained (safetensors) or by 'paratrain export --hf'"
        )
    located = {}
    for file in files:
        with open_weights(file) as handle:
            located.update(dict.fromkeys(handle.keys(), file))
    return located


@contextmanager
def open_weights(file: Path):
    """``safe_open`` on one weights file, with a damaged file (cut short by an interrupted copy or
    download, or not safetensors at all) named as the input to fix instead of a SafetensorError traceback.

    Raises:
        ConfigError: naming model.pretrained, the file and what safetensors found wrong.
    """
    try:
        handle = safe_open(file, framework="pt")
    except (SafetensorError, OSError) as error:
        raise ConfigError(
            f"model.pretrained: {str(file)!r} cannot be read as safetensors ({error}); the file is damaged or "
            f"incomplete (an interrupted copy or download?): copy or save the model directory again"
        ) from None
    with handle:
        yield handle


def check_pretrained_dir(directory: Path) -> None:
    """Before training: the directory exists and holds a config.json and safetensors weights.

    Raises:
        ConfigError: naming model.pretrained and what is missing.
    """
    if not directory.is_dir():
        raise ConfigError(
            f"model.pretrained={str(directory)!r} is not a directory; give a Hugging Face model directory"
        )
    if not (directory / "config.json").is_file():
        raise ConfigError(
            f"model.pretrained={str(directory)!r} has no config.json; give a directory written by save_pretrained "
            f"or 'paratrain export --hf'"
        )
    for file in set(weight_files(directory).values()):
        with open_weights(file):  # the header and the file's length: a file cut short is refused here
            pass


def pretrained_source(
    model: nn.Module, directory: Path, *, buffers: dict[str, torch.Tensor], what: str = "model.pretrained"
):
    """A ``models.weights.WeightSource`` reading the directory's tensors by the model's parameter names.

    Args:
        model: The model on meta (possibly laid out): its names and full shapes are checked first.
        buffers: Buffers computed by the model's constructor, for those the files do not hold.
        what: What the directory is, for the warning about tensors the model does not have: the files of
            ``model.pretrained``; a seed checkpoint holds the whole model, of which a pipeline stage keeps a part.

    Raises:
        ConfigError: naming the first few parameters the files lack or hold in another shape.
    """
    located = weight_files(directory)
    # LoRA: adapters are not in the base model's files, and a wrapped Linear keeps its weight under base_layer.
    expected = {
        base_name(canonical_name(name)): tuple(p.shape) for name, p in model.named_parameters() if not is_adapter(name)
    }
    stacked = _stacked_experts_in_parts(expected, located)
    _check_names_and_shapes({k: v for k, v in expected.items() if k not in stacked}, located, directory)
    parts = {part for names in stacked.values() for expert in names for part in expert}
    unused = sorted(set(located) - set(expected) - parts - {canonical_name(name) for name, _ in model.named_buffers()})
    if unused and what == "model.pretrained":
        logger.warning("model.pretrained: %d tensors the model does not have are ignored: %s", len(unused), unused[:5])

    def source(name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        if is_adapter(name):
            return None
        name = base_name(name)
        if name in stacked:
            return _read_stacked(stacked[name], located, tensor)
        file = located.get(name)
        if file is None:
            return buffers.get(name)
        # Opened per tensor: the file is memory-mapped, and pages left mapped would count as this
        # rank's memory until the end of loading.
        with open_weights(file) as handle:
            region = local_region(tensor)
            return handle.get_tensor(name) if region is None else LocalPiece(handle.get_slice(name)[region])

    return source


def _stacked_experts_in_parts(expected: dict[str, tuple], located: dict[str, Path]) -> dict[str, list[list[str]]]:
    """The stacked expert parameters the files hold per expert, as transformers saves them (models/expert_files.py):
    name -> each expert's file tensors."""
    stacked = {}
    for name, shape in expected.items():
        if name not in located and len(shape) == 3:
            names = find_per_expert_names(name, num_experts=shape[0], available=located)
            if names is not None:
                stacked[name] = names
    return stacked


def _read_stacked(names: list[list[str]], located: dict[str, Path], tensor: torch.Tensor):
    """This rank's experts of a stacked parameter (its region's experts: under ep, its own) read expert by expert."""

    def read(part: str) -> torch.Tensor:
        with open_weights(located[part]) as handle:
            return handle.get_tensor(part)

    region = local_region(tensor)
    if region is None:
        return read_stacked(names, range(len(names)), read)
    return LocalPiece(read_stacked(names, range(len(names))[region[0]], read)[(slice(None), *region[1:])])


def local_region(tensor: torch.Tensor) -> tuple[slice, ...] | None:
    """The index of this rank's piece of a sharded tensor in the full one, so only that piece is read;
    None for a plain tensor, or a piece that is not one box of the full tensor (a strided shard of fsdp over
    tp), which reads the whole tensor and keeps the slice."""
    box = box_of(tensor) if isinstance(tensor, DTensor) else None
    return None if box is None else box.slices()


def _check_names_and_shapes(expected: dict[str, tuple], located: dict[str, Path], directory: Path) -> None:
    missing = [name for name in expected if name not in located]
    shapes = {}
    for name in expected.keys() & located.keys():
        with open_weights(located[name]) as handle:
            shape = tuple(handle.get_slice(name).get_shape())
        if shape != expected[name]:
            shapes[name] = (shape, expected[name])
    problems = [f"{name} (not in the files)" for name in missing[:5]]
    problems += [f"{name} (files {list(a)}, model {list(b)})" for name, (a, b) in sorted(shapes.items())[:5]]
    if problems:
        raise ConfigError(
            f"model.pretrained={str(directory)!r} does not match the model: {'; '.join(problems)}"
            f"{' ...' if len(missing) + len(shapes) > len(problems) else ''}; use the model these weights were saved from"
        )
