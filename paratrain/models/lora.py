"""Low-rank adapters (LoRA) on a transformers model, through peft.

``apply_lora`` injects peft's LoRA layers into the model the factory built (on meta or for real): each
targeted Linear keeps its weight as ``<name>.base_layer.weight``, frozen (``requires_grad=False``), and
gains ``<name>.lora_A.default.weight`` and ``<name>.lora_B.default.weight``, the only parameters that
train. Everything downstream then sees a plain module with some frozen parameters: the layouts shard or
replicate it as any other (FSDP2 keeps frozen parameters sharded, without gradients), the optimizer takes
only the parameters that require grad, and checkpoints hold the whole model (the frozen base too, so a
resume needs nothing but the checkpoint).

peft's own module names are kept, so ``tools.export`` hands the adapter to peft to save in its format.
"""

from __future__ import annotations

import math
import re
import zlib

import torch
from torch import nn

from paratrain.config.schema import LoraConfig
from paratrain.errors import ConfigError
from paratrain.models.hf import is_transformers_model

ADAPTER_MARKER = ".lora_"
"""In the name of every adapter parameter, and of no base parameter."""
_BASE_LAYERS = re.compile(r"(?:\.base_layer)+\.")
_IN_BLOCK = re.compile(r"^.*?\.\d+\.")  # a parameter's name up to its block's index


def maybe_apply_lora(model: nn.Module, lora: LoraConfig | None) -> nn.Module:
    """The model with adapters when ``lora`` is set, else the model as it is."""
    return model if lora is None else apply_lora(model, lora)


def require_peft():
    """peft, or a ConfigError naming the extra that installs it (not a ModuleNotFoundError from every rank).

    Raises:
        ConfigError: peft is not installed.
    """
    try:
        import peft  # Lazy: peft is an optional dependency (the lora extra), imported only by LoRA runs.
    except ImportError:
        raise ConfigError("model.lora needs peft, which is not installed: pip install 'paratrain[lora]'") from None
    return peft


def apply_lora(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """Injects LoRA adapters into ``model`` and freezes everything else.

    Raises:
        ConfigError: the model is not a transformers model, or the targets match none of its Linear modules
            (their names listed).
    """
    if not is_transformers_model(model):
        raise ConfigError(
            f"model.lora: {type(model).__name__} is not a transformers model, which peft's LoRA wraps; use a "
            f"model from paratrain.models.hf:causal_lm (or model.pretrained), or remove model.lora"
        )
    _check_targets(model, lora.target_modules, parameters_too=bool(lora.target_parameters))
    _check_target_parameters(model, lora.target_parameters)
    peft = require_peft()
    return peft.inject_adapter_in_model(peft.LoraConfig(**_adapter_settings(lora)), model)


def peft_config(lora: LoraConfig, *, base_model: str | None = None):
    """peft's LoraConfig for the same adapters (what an exported adapter's adapter_config.json holds)."""
    return require_peft().LoraConfig(
        **_adapter_settings(lora), base_model_name_or_path=base_model, task_type="CAUSAL_LM"
    )


def _adapter_settings(lora: LoraConfig) -> dict:
    """peft's LoraConfig arguments for ``model.lora``: the same for training and for the exported adapter."""
    return {
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": lora.target_modules,
        "target_parameters": lora.target_parameters or None,
    }


def is_adapter(name: str) -> bool:
    return ADAPTER_MARKER in name


def base_name(name: str) -> str:
    """A parameter's name in the base model's own files: peft's ``base_layer`` components left out (one per
    adapter wrapped around the module: a module with two adapted parameters is wrapped twice)."""
    return _BASE_LAYERS.sub(".", name)


def init_adapter(name: str, tensor: torch.Tensor, seed: int) -> torch.Tensor | None:
    """The initial value of an adapter parameter, depending only on (seed, name), as peft initialises it:
    A Kaiming-uniform, B zero (so the adapted model starts as the base). None for other names."""
    if not is_adapter(name):
        return None
    full = torch.zeros(tensor.shape, dtype=tensor.dtype)
    if ".lora_A." in name:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        bound = 1 / math.sqrt(tensor.shape[1])  # kaiming_uniform_(a=sqrt(5)), peft's (and nn.Linear's) default
        full.uniform_(-bound, bound, generator=generator)
    return full


def _check_targets(model: nn.Module, targets: list[str] | str, *, parameters_too: bool) -> None:
    linear = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if targets == "all-linear" or (targets == [] and parameters_too):
        return
    if isinstance(targets, str):
        matched = [name for name in linear if re.fullmatch(targets, name)]
    else:
        matched = [name for name in linear if any(name == t or name.endswith(f".{t}") for t in targets)]
    if not matched:
        names = sorted({name.rsplit(".", 1)[-1] for name in linear})
        raise ConfigError(
            f"model.lora.target_modules={targets!r} matches no Linear module of {type(model).__name__}; its Linear "
            f"modules end in: {', '.join(names)}"
        )


def _check_target_parameters(model: nn.Module, targets: list[str]) -> None:
    names = [name for name, _ in model.named_parameters()]
    for target in targets:
        if not any(name == target or name.endswith(f".{target}") for name in names):
            # Named within their block (``model.layers.3.mlp.experts.down_proj`` -> ``mlp.experts.down_proj``).
            stacked = sorted({_IN_BLOCK.sub("", name) for name, p in model.named_parameters() if p.ndim == 3})
            raise ConfigError(
                f"model.lora.target_parameters: {target!r} names no parameter of {type(model).__name__}"
                + (f"; its stacked (expert) parameters end in: {', '.join(stacked)}" if stacked else "")
            )
