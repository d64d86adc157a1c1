"""Inspection aids that are off by default: full gradients or initial weights written to disk."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.models.init import canonical_name


def dump_gradients(model: nn.Module, path: Path, *, is_main: bool) -> None:
    """Gathers every gradient to full size (a collective: every rank calls this) and writes them
    from rank 0, keyed by the model's own parameter names."""
    gradients = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        if is_main:
            gradients[canonical_name(name)] = grad.detach().to("cpu", torch.float32).contiguous()
    if is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(gradients, str(path))


def dump_weights(model: nn.Module, path: Path, *, is_main: bool) -> None:
    """Gathers every parameter and buffer to full size (a collective: every rank calls this) and
    writes them from rank 0 under the model's own names: the initial weights of two layouts compare
    tensor by tensor."""
    weights = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if is_main:
            weights[canonical_name(name)] = full.detach().to("cpu").contiguous()
    if is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(path))
