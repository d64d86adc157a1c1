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
    StateDictOptions,
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

# Param-group settings saved once per parameter (``param_groups.<name>.lr``), like the moments
# (``state.<name>.exp_avg``). torch's default keeps them as one list naming the saver's parameters,
# written by one rank only: a pipeline rank holding other parameters then matched none of them and
# lost its groups' lr (issue 18).
_PER_PARAMETER = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class OptimizerState(Stateful):
    model: nn.Module
    optimizer: torch.optim.Optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer, options=_PER_PARAMETER)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Implementation flags (foreach) belong to this layout, not the one that saved: tensor
        # parallel needs foreach off where fsdp had it on. Hyperparameters come from the checkpoint,
        # except in a group this rank holds no parameter of (a pipeline stage without biases), whose
        # settings nothing saved names: it keeps its own.
        local = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=_PER_PARAMETER)
        for group, settings in zip(self.optimizer.param_groups, local, strict=True):
            group.update({k: settings[k] for k in _IMPLEMENTATION_FLAGS if k in settings})
            group.update({k: v for k, v in settings.items() if k not in group})


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
