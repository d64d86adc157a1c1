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


def plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` out of a wrapper subclass that holds one plain tensor of its own shape and dtype, aliasing
    its storage; a DTensor keeps its mesh and placements around the unwrapped local part; any other tensor
    as it is.

    torchao's float8 training keeps each FSDP-sharded weight it gathers in float8 in such a wrapper
    (``WeightWithDynamicFloat8CastTensor``). Saved as it is, a checkpoint pickles the wrapper's class, and
    torch.load's weights_only unpickler then refuses to read it wherever torchao is not imported (a bf16
    run resuming it, ``paratrain export``).
    """
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(tensor, dtensor.DTensor):
        local = tensor._local_tensor
        inner = plain_tensor(local)
        if inner is local:
            return tensor
        spec = tensor._spec
        return dtensor.DTensor.from_local(
            inner, spec.mesh, spec.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
        )
    if type(tensor) in (torch.Tensor, torch.nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
        return tensor
    names, _ = tensor.__tensor_flatten__()
    inner = getattr(tensor, names[0]) if len(names) == 1 else None
    if inner is None or inner.shape != tensor.shape or inner.dtype != tensor.dtype:
        return tensor
    return plain_tensor(inner)
