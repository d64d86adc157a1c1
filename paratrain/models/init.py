"""Allocating and initialising a model that was built on the meta device.

Every layout builds the model on ``meta`` (no memory), applies its parallelism, then materialises
here, so no rank ever holds more than its own shards plus one full tensor at a time.

A model that declares ``init_parameter(name, tensor, generator)`` gets values that depend only on
``(seed, name)``: each full tensor is drawn on the CPU from a generator seeded by the two, and each
rank keeps its own slice. Every layout, sharded or not, therefore starts from the same weights, which
is what lets a sharded run be checked against a single process. Other models fall back to each
submodule's ``reset_parameters()`` under ``torch.manual_seed(seed)``; their sharded initial weights
then differ from a single process's.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

# Wrappers that insert a path component without changing what the parameter is.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def declares_init(model: nn.Module) -> bool:
    return callable(getattr(model, "init_parameter", None))


def materialize(
    model: nn.Module, *, device: torch.device, seed: int, allocate_via: list[nn.Module] | None = None
) -> None:
    """Allocates every parameter and buffer on device and initialises it (see module docstring).

    Args:
        allocate_via: Modules that together hold all of the model's tensors, to allocate through
            instead of the model (pipeline stages: when FSDP wraps them, only they re-register
            the sharded parameters it tracks).
    """
    for module in allocate_via if allocate_via is not None else [model]:
        module.to_empty(device=device)
    with torch.no_grad():
        if declares_init(model):
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                _init_by_name(model, canonical_name(name), tensor, seed)
        else:
            torch.manual_seed(seed)
            for module in model.modules():
                if callable(getattr(module, "reset_parameters", None)):
                    module.reset_parameters()


def canonical_name(name: str) -> str:
    """The parameter's name as the model itself spells it, without wrapper path components."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _init_by_name(model: nn.Module, name: str, tensor: torch.Tensor, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    full = torch.empty(tensor.shape, dtype=tensor.dtype)
    model.init_parameter(name, full, generator)
    if isinstance(tensor, DTensor):
        # src_data_rank=None: every rank drew the same full tensor, so each keeps its slice, no comms.
        local = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
        tensor.to_local().copy_(local)
    else:
        tensor.copy_(full)
