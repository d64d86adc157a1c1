"""Moving a batch's tensors between devices (shared by the engines, the layouts that span devices and
evaluation) and a DTensor's local part, importing nothing but torch (so each of them may use it without
loading the others)."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


def move_to(batch: Any, device: torch.device) -> Any:
    """Moves tensors in a (nested) tuple, list or dict to device."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(move_to(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: move_to(value, device) for key, value in batch.items()}
    return batch


def output_device(outputs: Any, *, default: torch.device) -> torch.device:
    """Where the model's outputs are (its first tensor's device): under model_parallel the last part's
    GPU, where the targets must go for the loss."""
    tensors = [leaf for leaf in tree_leaves(outputs) if isinstance(leaf, torch.Tensor)]
    return tensors[0].device if tensors else default


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (``to_local``: gradients flow back to it); any other tensor as it is.

    DTensor is looked up, not imported: no tensor is one before torch.distributed.tensor is loaded, and
    importing it (with sympy) took a quarter of `paratrain train`'s start-up, whose launcher builds every
    model on meta in preflight without any layout.
    """
    dtensor = sys.modules.get("torch.distributed.tensor")
    return tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor.DTensor) else tensor
