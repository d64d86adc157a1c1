"""Everything that must survive a restart, each as a Stateful that DCP saves and loads.

Model and optimizer state go through torch's ``get_*_state_dict``/``set_*_state_dict``, which key
them by the model's own parameter names whatever wraps it (DDP now, sharded layouts later), so a
checkpoint does not depend on the layout that wrote it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


@dataclass
class ModelState(Stateful):
    model: nn.Module

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


_IMPLEMENTATION_FLAGS = ("foreach", "fused")


@dataclass
class OptimizerState(Stateful):
    model: nn.Module
    optimizer: torch.optim.Optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Implementation flags (foreach) belong to this layout, not the one that saved: tensor
        # parallel needs foreach off where fsdp had it on. Hyperparameters come from the checkpoint.
        local_flags = [
            {k: group[k] for k in _IMPLEMENTATION_FLAGS if k in group} for group in self.optimizer.param_groups
        ]
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)
        for group, flags in zip(self.optimizer.param_groups, local_flags, strict=True):
            group.update(flags)


@dataclass
class Progress(Stateful):
    """Optimizer steps completed."""

    step: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.step = int(state_dict["step"])


@dataclass
class RNGState(Stateful):
    """This rank's random generators, keyed by rank: ranks may differ (e.g. dropout masks)."""

    rank: int
    device: torch.device

    def state_dict(self) -> dict[str, Any]:
        return {f"rank{self.rank}": self._capture()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restore(state_dict[f"rank{self.rank}"])

    def _capture(self) -> dict[str, Any]:
        state = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _restore(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        random.setstate(_as_python_random_state(state["python"]))
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)


def _as_python_random_state(saved: Any) -> tuple:
    # DCP flattens containers on the way in; random.setstate wants the original nested tuples back.
    version, internal, gauss = saved
    return int(version), tuple(int(x) for x in internal), gauss
