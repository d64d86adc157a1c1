"""Per-block activation checkpointing (full or selective) and torch.compile."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from paratrain.models.plan_derivation import ParallelPlan

# The operators whose outputs selective checkpointing keeps, by name under torch.ops (resolved when first
# used; a name this torch lacks is skipped). torchtitan's save list is the model: matmuls (a Linear with a
# bias is addmm, a 3-d matmul bmm), every scaled_dot_product_attention kernel, and what would cost a second
# collective to recompute. Unlike torchtitan it keeps every matmul rather than every other one: the
# recomputation left is then elementwise and cheap, and activation_checkpointing_every is the dial for less
# memory.
SAVED_OPERATORS = (
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.baddbmm.default",
    "aten.linear.default",  # backends that keep linear whole instead of decomposing it into mm
    "aten._scaled_mm.default",  # float8's matmul
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    # float8's absolute maxima, from which its scales come: a scalar each, and torchtitan keeps them too
    "aten.max.default",
    # tensor parallel's reductions of a row-parallel layer's output, expert parallel's token exchange:
    # recomputing them would communicate again in backward
    "_c10d_functional.all_reduce.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_to_all_single.default",
)

Checkpointing = Literal["full", "selective"]


def apply_activation_checkpointing(
    model: nn.Module, *, plan: ParallelPlan, mode: Checkpointing = "full", every: int = 1
) -> None:
    """Wraps the k-th, 2k-th, ... block (k = ``every``) of ``plan.blocks`` so backward recomputes its
    activations instead of reading them stored: all of them (full), or all but the outputs of
    ``SAVED_OPERATORS`` (selective, torch's ``create_selective_checkpoint_contexts``).

    The wrapper adds ``_checkpoint_wrapped_module`` to parameter paths; torch's state-dict helpers
    remove it again, so checkpoints keep the model's own names.
    """
    for index, path in enumerate(plan.blocks):
        if (index + 1) % every:
            continue
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        parent.register_module(name, _checkpointed(parent.get_submodule(name), mode))


def _checkpointed(block: nn.Module, mode: Checkpointing) -> nn.Module:
    if mode == "full":
        return checkpoint_wrapper(block, preserve_rng_state=True)
    return checkpoint_wrapper(block, preserve_rng_state=True, context_fn=_selective_contexts)


def _selective_contexts():
    """A fresh pair of contexts for each checkpointed forward (they hold that forward's saved outputs)."""
    return create_selective_checkpoint_contexts(list(saved_operators()))


@functools.cache
def saved_operators() -> frozenset:
    """SAVED_OPERATORS as torch's operator objects, those this torch has."""
    found = set()
    for name in SAVED_OPERATORS:
        namespace, operator, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), operator, None)
        if packet is not None and hasattr(packet, overload):
            found.add(getattr(packet, overload))
    return frozenset(found)


def apply_compile(
    model: nn.Module, *, plan: ParallelPlan, backend: str = "inductor", checkpointing: str = "none"
) -> None:
    """Compiles each block in place (``nn.Module.compile`` keeps parameter names unchanged).

    A fully checkpointed block is compiled inside its checkpoint wrapper, so the checkpoint recomputes
    a compiled forward. Compiling the wrapper instead (dynamo tracing ``torch.utils.checkpoint``) fails
    on tensor-parallel blocks in torch 2.13: the traced checkpoint saves the DTensors' DeviceMesh among
    its tensors and the first step dies with ``expected all tensors_saved_with_vc_check to be Tensors``.
    Compiled inside, tp, fsdp and single with both options train.

    A selectively checkpointed block is compiled wrapper and all, as torchtitan compiles it: dynamo
    traces the policy and the partitioner keeps what it saves. Inside the wrapper the policy would see
    inductor's matmuls as out= kernels (``aten.addmm.out``), which it does not save, and backward would
    recompute them as full checkpointing does. This way tp, fsdp, fsdp + tp and single train (the
    DeviceMesh failure above is full checkpointing's alone).

    Args:
        checkpointing: ``parallel.activation_checkpointing``: which wrapper the blocks may have.
    """
    for path in plan.blocks:
        block = model.get_submodule(path)
        if checkpointing == "full":
            block = getattr(block, "_checkpoint_wrapped_module", block)
        block.compile(backend=backend)


def compile_loss(loss_fn: Callable, *, compile: bool, backend: str = "inductor") -> Callable:
    """The loss compiled beside the blocks when ``parallel.compile`` is on: a language model's loss is a
    full-vocabulary cross-entropy, eager a separate pass over the largest activation of the step."""
    return torch.compile(loss_fn, backend=backend) if compile else loss_fn
