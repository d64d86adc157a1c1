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

from paratrain.tensors import plain_tensor


@dataclass
class ModelState(Stateful):
    model: nn.Module

    def state_dict(self) -> dict[str, Any]:
        # Plain tensors (aliasing the weights, so a load into them still lands in the model): float8's
        # wrapped weights would otherwise be pickled with their class (tensors.plain_tensor).
        return {name: plain_tensor(value) for name, value in get_model_state_dict(self.model).items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


_IMPLEMENTATION_FLAGS = ("foreach", "fused")

# Param-group settings saved once per parameter (``param_groups.<name>.lr``), like the moments
# (``state.<name>.exp_avg``). torch's default keeps them as one list naming the saver's parameters,
# written by one rank only: a pipeline rank holding other parameters then matched none of them and
# lost its groups' lr.
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
        # torch builds the state to load into by a zero-gradient step, but skips it when any gradient is
        # left (a replica group's step that was not committed, before it heals), and then loads no moment
        # at all: AdamW would go on as if new. Gradients mean nothing across a load.
        self.optimizer.zero_grad(set_to_none=True)
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=_PER_PARAMETER)
        for group, settings in zip(self.optimizer.param_groups, local, strict=True):
            group.update({k: settings[k] for k in _IMPLEMENTATION_FLAGS if k in settings})
            group.update({k: v for k, v in settings.items() if k not in group})
            if group.get("fused"):
                self._steps_beside_parameters(group)

    def _steps_beside_parameters(self, group: dict[str, Any]) -> None:
        # torch placed the step counts as the saving layout's flags asked (foreach: on the CPU); a fused
        # kernel needs them on the parameters' device.
        for param in group["params"]:
            state = self.optimizer.state.get(param, {})
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].to(device=param.device, dtype=torch.float32)


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
    """This rank's random generators, keyed by rank: ranks may differ (e.g. dropout masks).

    On GPUs, one CUDA generator per device the rank computes on (DataParallel's replicas and
    model_parallel's parts run on several), saved as ``cuda`` (the rank's own device), ``cuda_1``,
    ``cuda_2``, ... A checkpoint from a run on fewer devices restores the generators it has; the
    checkpointer names the others, which keep their seeds (see SavedEntriesOnly).
    """

    rank: int
    devices: list[torch.device]

    def state_dict(self) -> dict[str, Any]:
        return {f"rank{self.rank}": self._capture()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restore(state_dict[f"rank{self.rank}"])

    def _capture(self) -> dict[str, Any]:
        state = {"torch": torch.get_rng_state(), "python": random.getstate()}
        for name, device in cuda_generator_names(self.devices).items():
            state[name] = torch.cuda.get_rng_state(device)
        return state

    def _restore(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        random.setstate(_as_python_random_state(state["python"]))
        for name, device in cuda_generator_names(self.devices).items():
            if name in state:
                torch.cuda.set_rng_state(state[name], device)


# Loaded only where the checkpoint has them. RNG states are saved per rank: a run resumed on more ranks has
# none for the new ones. A run switched to fp16 resumes a checkpoint without a gradient scaler: its scaler
# starts fresh. A checkpoint of a plain run resumed by replica groups holds no counts: they start at 0. A DPO run
# resuming another run's checkpoint holds no reference log-probabilities: they are computed.
OPTIONAL_STATE = ("rng", "grad_scaler", "replica_groups", "preference_reference")


MODEL_PREFIX = "model."
"""What the keys of the model's entries start with (``training_state`` names it ``model``)."""


def training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Stateful, *, data: Stateful, rng: RNGState
) -> dict[str, Stateful]:
    """The Statefuls every resume needs but the step count, under the names checkpoints store them by (the
    trainer adds ``progress``, ``scaler_state`` under fp16 and the replica groups' counts)."""
    return {
        "model": ModelState(model),
        "optimizer": OptimizerState(model, optimizer),
        "lr_scheduler": lr_scheduler,
        "data": data,
        "rng": rng,
    }


def scaler_state(grad_scaler: Stateful | None) -> dict[str, Stateful]:
    """fp16's gradient scaler, under its checkpoint name; nothing without one (a run switched to fp16 resumes a
    checkpoint without it, and its scaler starts fresh)."""
    return {} if grad_scaler is None else {"grad_scaler": grad_scaler}


def cuda_generator_names(devices: list[torch.device]) -> dict[str, torch.device]:
    """The checkpoint names of the CUDA generators of ``devices`` (the rank's own first): cuda, cuda_1, ..."""
    cuda = [device for device in devices if device.type == "cuda"]
    return {("cuda" if position == 0 else f"cuda_{position}"): device for position, device in enumerate(cuda)}


class SavedEntriesOnly(Stateful):
    """Loads the entries of ``stateful`` that a checkpoint has; the others keep their current values.

    DCP asks for every entry of the state it loads into and fails on one the checkpoint lacks. A run
    resumed on more GPUs per rank has generators nothing saved (RNGState), which start as seeded.

    Args:
        name: The stateful's name in the checkpoint (the first part of its keys).
        saved_keys: The checkpoint's keys, as its metadata lists them.
    """

    def __init__(self, stateful: Stateful, name: str, saved_keys: set[str]):
        self.stateful, self.name, self.saved_keys = stateful, name, saved_keys
        self.absent: list[str] = []  # keys of entries the checkpoint lacks, filled by state_dict()

    def state_dict(self) -> dict[str, Any]:
        self.absent = []
        return self._saved_part(self.stateful.state_dict(), self.name)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        current = self.stateful.state_dict()
        _merge_into(current, state_dict)
        self.stateful.load_state_dict(current)

    def _saved_part(self, state: dict[str, Any], prefix: str) -> dict[str, Any]:
        kept = {}
        for key, value in state.items():
            path = f"{prefix}.{key}"
            if not is_saved(path, self.saved_keys):
                self.absent.append(path)
            elif isinstance(value, dict):
                kept[key] = self._saved_part(value, path)
            else:
                kept[key] = value
        return kept


def is_saved(path: str, saved_keys) -> bool:
    """Whether a checkpoint holds the entry at ``path`` (a key of its metadata, or the prefix of some)."""
    return any(saved == path or saved.startswith(path + ".") for saved in saved_keys)


def _merge_into(target: dict[str, Any], loaded: dict[str, Any]) -> None:
    for key, value in loaded.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge_into(target[key], value)
        else:
            target[key] = value


def _as_python_random_state(saved: Any) -> tuple:
    # DCP flattens containers on the way in; random.setstate wants the original nested tuples back.
    version, internal, gauss = saved
    return int(version), tuple(int(x) for x in internal), gauss
