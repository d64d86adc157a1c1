"""The parallel plan a model declares beside its modules, as data.

Models carry no training infrastructure. They only say how they may be cut: which submodules are the
repeated blocks (the units that FSDP shards, activation checkpointing wraps and pipeline stages split
between). Layouts read the plan; they never guess at a model's structure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

TensorParallelStyle = Literal["colwise", "rowwise"]


@dataclass(frozen=True)
class ParallelPlan:
    """How a model may be split.

    Attributes:
        blocks: Module paths (as in ``model.get_submodule``) of the repeated blocks, in forward order.
        block_tp_plan: Tensor-parallel style of linear layers inside each block, by path relative
            to the block: "colwise" splits output features, "rowwise" input features (Megatron style:
            a colwise layer feeds a rowwise one, so each pair needs one all-reduce).
        block_norms: Paths of each block's norm layers, relative to the block, that sequence
            parallel shards along the sequence dimension.
        tp_divisible: Sizes a tensor-parallel degree must divide, by the config key that sets them
            (e.g. ``{"model.args.n_head": 4}``).
        pipeline_sequence: Module paths whose chained calls, ``x = module(x)`` in this order, compute
            exactly what the model's forward computes. Pipeline stages and model-parallel parts are cut
            between them, so together they must hold every parameter. ``nn.Sequential`` models get
            their children by default.
    """

    blocks: tuple[str, ...] = ()
    block_tp_plan: Mapping[str, TensorParallelStyle] = field(default_factory=dict)
    block_norms: tuple[str, ...] = ()
    tp_divisible: Mapping[str, int] = field(default_factory=dict)
    pipeline_sequence: tuple[str, ...] = ()


def plan_of(model: nn.Module) -> ParallelPlan:
    """The plan a model declares through a ``parallel_plan()`` method; for an ``nn.Sequential`` without
    one, its children as the pipeline sequence; for a Hugging Face model, its blocks from
    ``_no_split_modules``; otherwise an empty plan."""
    declare = getattr(model, "parallel_plan", None)
    if callable(declare):
        return declare()
    if isinstance(model, nn.Sequential):
        return ParallelPlan(pipeline_sequence=tuple(name for name, _ in model.named_children()))
    return ParallelPlan(blocks=no_split_blocks(model))


def no_split_blocks(model: nn.Module) -> tuple[str, ...]:
    """Paths of the outermost submodules whose class a transformers model names in ``_no_split_modules``
    (its decoder layers: what Accelerate and transformers' own FSDP wrapping take as units), in
    registration order, which is forward order for transformers' decoders."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks: list[str] = []
    for path, module in model.named_modules():
        inside_a_block = any(path.startswith(block + ".") for block in blocks)
        if path and not inside_a_block and type(module).__name__ in names:
            blocks.append(path)
    return tuple(blocks)
