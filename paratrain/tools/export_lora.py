"""Exports of a LoRA run's checkpoint: the adapter in peft's format, or the model with it merged in.

The adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) is what
``PeftModel.from_pretrained(base, DIR)`` loads onto the base model, and what serving stacks (vLLM's
``--lora-modules``, TGI) take. peft stores adapter ``default``'s tensors as
``base_model.model.<module>.lora_A.weight``: paratrain's checkpoint holds them as
``<module>.lora_A.default.weight`` (peft's modules, injected as they are). Only the adapter's tensors are
read, never a base weight: the checkpoint writer keeps them in files of their own (checkpoint.file_groups).

The merged model is the base with ``W + alpha / r * B @ A`` in place of each adapted weight, under the base
model's own names: a plain Hugging Face model directory. It is streamed as the full export is, one module at
a time: each merged weight is computed from that module's base weight and its two small adapter tensors,
written, and let go before the next is read.
"""

from __future__ import annotations

from collections.abc import Iterator
from operator import itemgetter
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from paratrain.checkpoint.state import MODEL_PREFIX
from paratrain.checkpoint.tensor_reader import TensorReader
from paratrain.config.schema import LoraConfig
from paratrain.models.lora import base_name, is_adapter, peft_config
from paratrain.models.weights import canonical_name

ADAPTER_NAME = "default"
_ADAPTED_WEIGHT = ".base_layer.weight"  # peft's name for the weight of a module it adapted
_WRAPPED = ".base_layer"  # peft's name for the module it wrapped, once per adapter around it


def export_adapter(reader: TensorReader, lora: LoraConfig, out_dir: Path, *, base: str | None) -> int:
    """Writes the checkpoint's adapter as a peft adapter directory, reading its adapter tensors only."""
    from safetensors.torch import save_file  # Lazy: safetensors only for exports

    keys = [key for key in reader.tensors(MODEL_PREFIX) if is_adapter(key)]
    adapter = {_peft_name(key): tensor.contiguous() for key, tensor in reader.read(keys)}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(adapter, out_dir / "adapter_model.safetensors", metadata={"format": "pt"})
    peft_config(lora, base_model=base).save_pretrained(str(out_dir))  # last: a finished export has its config
    return len(adapter)


def merged_model(
    reader: TensorReader, lora: LoraConfig
) -> tuple[dict[str, TensorStorageMetadata], Iterator[torch.Tensor]]:
    """The base model's tensors by the base's own names, and a stream of them in that order, each adapted
    weight with its adapter's update added."""
    base = {key: item for key, item in reader.tensors(MODEL_PREFIX).items() if not is_adapter(key)}
    entries = {base_name(canonical_name(key.removeprefix(MODEL_PREFIX))): item for key, item in base.items()}
    adapters = {key: _adapter_of(key, reader) for key in base}
    return entries, _merged(reader, adapters, scaling=lora.alpha / lora.r)


def merge_adapter(weight: torch.Tensor, *, down: torch.Tensor, up: torch.Tensor, scaling: float) -> torch.Tensor:
    """``weight + scaling * up @ down``, computed in float32, in ``weight``'s dtype (an fp32 weight is updated
    in place: no second copy of it). A stacked expert weight ``(experts, out, in)`` (peft's
    ``target_parameters``) takes expert e's own update: A's rows ``e*r .. e*r+r`` and B's columns ``j*experts +
    e``, as peft lays them out."""
    merged = weight.float()
    if weight.ndim == 3:
        experts = weight.shape[0]
        per_expert_down = down.float().reshape(experts, -1, down.shape[-1])  # (experts, r, in)
        per_expert_up = up.float().reshape(up.shape[0], -1, experts).permute(2, 0, 1)  # (experts, out, r)
        merged.baddbmm_(per_expert_up, per_expert_down, alpha=scaling)
    else:
        merged.addmm_(up.float(), down.float(), alpha=scaling)
    return merged.to(weight.dtype)


def _merged(reader: TensorReader, adapters: dict[str, tuple[str, ...]], *, scaling: float) -> Iterator[torch.Tensor]:
    # One read in the order the merge needs: each base weight, then its module's A and B.
    tensors = map(itemgetter(1), reader.read(key for base in adapters for key in (base, *adapters[base])))
    for base in adapters:
        weight = next(tensors)
        if adapters[base]:
            weight = merge_adapter(weight, down=next(tensors), up=next(tensors), scaling=scaling)
        yield weight
        del weight  # let go before the next is read


def _adapter_of(key: str, reader: TensorReader) -> tuple[str, ...]:
    """The keys of the adapter (A, B) that adapts the weight ``key``; none for a weight not adapted."""
    if key.endswith(_ADAPTED_WEIGHT):
        return _adapter_at(key.removesuffix(_ADAPTED_WEIGHT), reader)
    return _parameter_adapter_of(key, reader)


def _adapter_at(module: str, reader: TensorReader) -> tuple[str, ...]:
    down, up = f"{module}.lora_A.{ADAPTER_NAME}.weight", f"{module}.lora_B.{ADAPTER_NAME}.weight"
    saved = reader.metadata.state_dict_metadata
    return (down, up) if down in saved and up in saved else ()


def _parameter_adapter_of(key: str, reader: TensorReader) -> tuple[str, ...]:
    """The adapter of a stacked expert weight ``M.base_layer[.base_layer...].NAME``: peft wraps module M once
    per adapted parameter, so the adapter sits on one of those wrappers; the one whose A and B fit the
    weight's ``(experts, out, in)``. Raises where two would fit (the checkpoint cannot say which)."""
    saved = reader.metadata.state_dict_metadata
    module, shape = key.rpartition(".")[0], tuple(saved[key].size)
    if not module.endswith(_WRAPPED) or len(shape) != 3:
        return ()
    _, out_features, in_features = shape
    fitting = [
        (down, up)
        for down, up in filter(None, (_adapter_at(wrapper, reader) for wrapper in _wrappers_of(module)))
        if saved[down].size[1] == in_features and saved[up].size[0] == out_features
    ]
    if len(fitting) > 1:
        raise ValueError(f"{key}: {len(fitting)} adapters fit its shape {shape}; merge it with peft instead")
    return fitting[0] if fitting else ()


def _wrappers_of(module: str) -> list[str]:
    """``M.base_layer.base_layer`` -> ``[M.base_layer, M]``: every peft wrapper around the module, innermost first."""
    wrappers = []
    while module.endswith(_WRAPPED):
        module = module.removesuffix(_WRAPPED)
        wrappers.append(module)
    return wrappers


def _peft_name(key: str) -> str:
    return "base_model.model." + canonical_name(key.removeprefix(MODEL_PREFIX)).replace(f".{ADAPTER_NAME}.", ".")
