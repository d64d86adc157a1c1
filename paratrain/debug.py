"""Inspection aids that are off by default: full gradients written to disk, one tensor at a time."""

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
