"""The parallel plan a model declares beside its modules, as data.

Models carry no training infrastructure. They only say how they may be cut: which submodules are the
repeated blocks (the units that FSDP shards, activation checkpointing wraps and pipeline stages split
between). Layouts read the plan; they never guess at a model's structure.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ParallelPlan:
    """How a model may be split.

    Attributes:
        blocks: Module paths (as in ``model.get_submodule``) of the repeated blocks, in forward order.
    """

    blocks: tuple[str, ...] = ()


def plan_of(model: nn.Module) -> ParallelPlan:
    """The plan a model declares through a ``parallel_plan()`` method, or an empty plan."""
    declare = getattr(model, "parallel_plan", None)
    return declare() if callable(declare) else ParallelPlan()
