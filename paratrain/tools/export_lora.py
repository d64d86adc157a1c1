"""Exports of a LoRA run's checkpoint: the adapter in peft's format, or the model with it merged in.

The adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) is what
``PeftModel.from_pretrained(base, DIR)`` loads onto the base model, and what serving stacks (vLLM's
``--lora-modules``, TGI) take. peft stores adapter ``default``'s tensors as
``base_model.model.<module>.lora_A.weight``: paratrain's checkpoint holds them as
``<module>.lora_A.default.weight`` (peft's modules, injected as they are).

The merged model is the base with ``W + alpha / r * B @ A`` in place of each adapted weight, under the base
model's own names: a plain Hugging Face model directory. It is built in memory (a LoRA run's model fits one
process, or its base would not have been a pretrained download), unlike the full exports' streaming.
"""

from __future__ import annotations

from pathlib import Path

import torch

from paratrain.config.schema import LoraConfig
from paratrain.models.lora import base_name, is_adapter, peft_config
from paratrain.models.weights import canonical_name

ADAPTER_NAME = "default"


def export_adapter(tensors: dict[str, torch.Tensor], lora: LoraConfig, out_dir: Path, *, base: str | None) -> int:
    """Writes the adapter of ``tensors`` (a checkpoint's model tensors by name) as a peft adapter directory."""
    from safetensors.torch import save_file  # Lazy: safetensors only for exports

    adapter = {
        "base_model.model." + canonical_name(name).replace(f".{ADAPTER_NAME}.", "."): tensor.contiguous()
        for name, tensor in tensors.items()
        if is_adapter(name)
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(adapter, out_dir / "adapter_model.safetensors", metadata={"format": "pt"})
    peft_config(lora, base_model=base).save_pretrained(str(out_dir))  # last: a finished export has its config
    return len(adapter)


def merged_tensors(tensors: dict[str, torch.Tensor], lora: LoraConfig) -> dict[str, torch.Tensor]:
    """The base model's tensors, each adapted weight with its adapter's update added, by the base's names."""
    merged = {}
    for name, tensor in tensors.items():
        name = canonical_name(name)
        if is_adapter(name):
            continue
        if name.endswith(".base_layer.weight"):
            module = name.removesuffix(".base_layer.weight")
            down = tensors[f"{module}.lora_A.{ADAPTER_NAME}.weight"].float()
            up = tensors[f"{module}.lora_B.{ADAPTER_NAME}.weight"].float()
            tensor = (tensor.float() + (lora.alpha / lora.r) * up @ down).to(tensor.dtype)
        merged[base_name(name)] = tensor.contiguous()
    return merged
