"""The devices one rank computes on: usually its own, several for the one-process multi-GPU layouts."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.parallel.model_parallel import ModelParallel


def devices_computed_on(runnable: nn.Module, *, own: torch.device) -> list[torch.device]:
    """The rank's own device first, then the others its forward runs on: DataParallel's replicas'
    GPUs, or model_parallel's parts' devices. Their random generators are checkpointed and their
    memory reported (paratrain.callbacks.memory)."""
    if isinstance(runnable, nn.DataParallel):
        others = [torch.device("cuda", index) for index in runnable.device_ids]
    elif isinstance(runnable, ModelParallel):
        others = list(runnable.devices)
    else:
        others = []
    return list(dict.fromkeys(_with_index(device) for device in [own, *others]))


def _with_index(device: torch.device) -> torch.device:
    # "cuda" and "cuda:0" name one GPU; only the second compares equal to the other spellings of it.
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
