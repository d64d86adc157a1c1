"""Per-block activation checkpointing and torch.compile."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from paratrain.models.plan_derivation import ParallelPlan


def apply_activation_checkpointing(model: nn.Module, *, plan: ParallelPlan) -> None:
    """Wraps each block so its activations are recomputed in backward instead of stored.

    The wrapper adds ``_checkpoint_wrapped_module`` to parameter paths; torch's state-dict helpers
    remove it again, so checkpoints keep the model's own names.
    """
    for path in plan.blocks:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        parent.register_module(name, checkpoint_wrapper(parent.get_submodule(name), preserve_rng_state=True))


def apply_compile(model: nn.Module, *, plan: ParallelPlan, backend: str = "inductor") -> None:
    """Compiles each block in place (``nn.Module.compile`` keeps parameter names unchanged).

    A block under activation checkpointing is compiled inside its checkpoint wrapper, so the
    checkpoint recomputes a compiled forward. Compiling the wrapper instead (dynamo tracing
    ``torch.utils.checkpoint``) fails on tensor-parallel blocks in torch 2.13: the traced checkpoint
    saves the DTensors' DeviceMesh among its tensors and the first step dies with ``expected all
    tensors_saved_with_vc_check to be Tensors`` (issue 18). Compiled inside, tp, fsdp and single
    with both options train.
    """
    for path in plan.blocks:
        block = model.get_submodule(path)
        getattr(block, "_checkpoint_wrapped_module", block).compile(backend=backend)


def compile_loss(loss_fn: Callable, *, compile: bool, backend: str = "inductor") -> Callable:
    """The loss compiled beside the blocks when ``parallel.compile`` is on: a language model's loss is a
    full-vocabulary cross-entropy, eager a separate pass over the largest activation of the step."""
    return torch.compile(loss_fn, backend=backend) if compile else loss_fn
