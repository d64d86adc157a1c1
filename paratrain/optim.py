"""Optimizer and learning-rate schedule from the ``optim`` config section."""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from paratrain.config.schema import OptimConfig
from paratrain.errors import ConfigError
from paratrain.tensors import local_part


def scaled_lr(options: OptimConfig, *, dp_size: int) -> float:
    """Peak lr after the optional scaling by data-parallel size."""
    factor = {"none": 1.0, "linear": float(dp_size), "sqrt": math.sqrt(dp_size)}[options.lr_scaling]
    return options.lr * factor


# Where torch has fused AdamW and SGD kernels that paratrain runs: every parameter on one of these kinds.
FUSED_DEVICE_TYPES = frozenset({"cuda", "cpu"})


def use_fused_kernel(device_types: set[str], *, uniform: bool, setting: str = "auto") -> bool:
    """Whether the optimizer runs torch's fused kernel (``optim.fused``).

    Fused kernels take only parameters of one kind (all DTensor or all plain, see foreach). auto picks
    them where every parameter is on CUDA, or every one on the CPU: one kernel per parameter group
    instead of foreach's dozen. On the CPU that is 0.89 x foreach's step in one process, the same under
    fsdp, and half of a fresh process's first step over DTensors, where each distinct op pays DTensor's
    sharding propagation once (~5 ops instead of ~17): a restarted replica group's first step, which
    the live groups wait for (benchmarks/optimizer_kernels.py).
    """
    check_fused_setting(setting, uniform=uniform)
    if setting == "off" or not uniform:
        return False
    return setting == "on" or (len(device_types) == 1 and device_types <= FUSED_DEVICE_TYPES)


def check_fused_setting(setting: str, *, uniform: bool) -> None:
    """Refuses optim.fused=on for parameters of mixed kinds (tensor parallel alone: sharded linears beside
    plain embeddings and norms), which torch's fused kernels reject."""
    if setting == "on" and not uniform:
        raise ConfigError(
            "optim.fused=on: torch's fused kernels take parameters of one kind, and this layout mixes sharded "
            "and plain ones (tensor parallel alone); set optim.fused=auto"
        )


def build_optimizer(model: nn.Module, options: OptimConfig, *, dp_size: int) -> torch.optim.Optimizer:
    """AdamW or SGD. Weight decay applies to matrices only (not biases, norms' scales), as in GPT-2.

    The two parameter groups are the same in every layout, so optimizer and schedule state move
    between layouts. Tensor parallel alone leaves some parameters sharded (DTensor) and others
    plain; torch's multi-tensor kernels refuse that mix, so such a model steps one tensor at a time.
    On CUDA and on the CPU the fused kernel runs (one kernel per group instead of foreach's several),
    and it can skip a step on the device (see paratrain.nonfinite).
    """
    # lazy: DTensor's import (with sympy, ~0.6 s) stays out of the launcher, whose preflight imports this module
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": options.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    if len(params) < len(list(model.parameters())):
        # Frozen parameters (LoRA: only the adapters train, all matrices, in every layout alike): an empty group
        # is left out, as torch's set_optimizer_state_dict fails on a last group without parameters (IndexError
        # in _unflatten_optim_state_dict, torch 2.13).
        groups = [group for group in groups if group["params"]]
    foreach = len({isinstance(p, DTensor) for p in params}) == 1
    fused = use_fused_kernel({p.device.type for p in params}, uniform=foreach, setting=options.fused)
    kernel = {"fused": True} if fused else {"foreach": foreach}
    lr = scaled_lr(options, dp_size=dp_size)
    if options.name == "adamw":
        return ShardLocalAdamW(groups, lr=lr, betas=options.betas, eps=options.eps, **kernel)
    return torch.optim.SGD(groups, lr=lr, momentum=options.momentum, **kernel)


class ShardLocalAdamW(torch.optim.AdamW):
    """torch's AdamW, whose kernels take this rank's shards (plain tensors) where a group's parameters,
    gradients and moments are DTensors laid out alike (fsdp, hsdp, fsdp x tp), and the DTensors
    themselves otherwise.

    AdamW's update is elementwise: on a shard it is the DTensor's update, bit for bit. What it saves is
    DTensor's dispatch around each kernel, whose sharding propagation a fresh process works out anew for
    every op: 46 ms of a restarted process's first step on the tests' tiny GPT under fsdp (1 ms later),
    a step that every live replica group waits for. The optimizer's state stays DTensors, as checkpoints
    and a healing peer expect; only the lists torch hands its kernels hold the shards."""

    def _init_group(self, group: dict, *per_parameter: Any) -> Any:
        found = super()._init_group(group, *per_parameter)
        lists = [entries for entries in per_parameter if isinstance(entries, list)]  # lists, not flags
        if laid_out_like_their_parameters(lists):
            for entries in lists:
                entries[:] = [local_part(tensor) for tensor in entries]
        return found


def laid_out_like_their_parameters(lists: list[list[Any]]) -> bool:
    """Whether ``lists`` (parameters first, then their gradients, moments and step counts, one entry per
    parameter in each, or none) hold DTensors, each on its parameter's mesh with its parameter's placements, and
    beside them only scalar step counts: then every kernel input is a shard of the same cut."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # looked up: no DTensor exists before it is imported
    if dtensor is None or not lists or not lists[0]:
        return False
    parameters, others = lists[0], [entries for entries in lists[1:] if entries]  # amsgrad's maxima: none without
    if any(len(entries) != len(parameters) for entries in others):
        return False
    for index, parameter in enumerate(parameters):
        if not isinstance(parameter, dtensor.DTensor):
            return False
        for entries in others:
            entry = entries[index]
            if isinstance(entry, dtensor.DTensor):
                same_mesh = entry.device_mesh is parameter.device_mesh or entry.device_mesh == parameter.device_mesh
                if not same_mesh or entry.placements != parameter.placements:
                    return False
            elif not (isinstance(entry, torch.Tensor) and entry.ndim == 0):
                return False
    return True


def build_lr_scheduler(optimizer: torch.optim.Optimizer, options: OptimConfig, *, max_steps: int) -> LambdaLR:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` at max_steps (or constant)."""
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, options, max_steps=max_steps))


def lr_multiplier(step: int, options: OptimConfig, *, max_steps: int) -> float:
    """Fraction of the peak lr used by the optimizer step taken after ``step`` completed steps."""
    if step < options.warmup_steps:
        return (step + 1) / options.warmup_steps
    if options.schedule == "constant":
        return 1.0
    decay_steps = max(1, max_steps - options.warmup_steps)
    progress = min(1.0, (step - options.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return options.min_lr_ratio + (1.0 - options.min_lr_ratio) * cosine
