"""What a live replica group sends a healing one, and how the healing rank loads it: the model and the optimizer
as this rank's shards (plain tensors), every group having built the same model and optimizer on the same inner
layout, so each rank's counterpart holds the same cut.

torchft's transport pickles what it is given, and the receiver reads it with ``weights_only=True``. DTensors went
as themselves, each with its mesh and placements to rebuild: reading the tests' tiny GPT's 111 of them took twice
as long as reading their shards (28 against 14 ms, two ranks on two cores under load), writing them too (9 against 4 ms),
while every live group waited. The healing rank wraps each shard in its own parameter's mesh and placements."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils._pytree import tree_map_only

from paratrain.tensors import local_part


def as_shards(state: Any) -> Any:
    """``state`` (nested dicts and lists) with each DTensor replaced by this rank's shard: the same storage."""
    with torch.no_grad():  # to_local outside autograd: the shard itself, not a view autograd tracks
        return tree_map_only(torch.Tensor, local_part, state)


def laid_out_as(shard: Any, template: Any, *, copy: bool = False) -> Any:
    """``shard`` (a peer's part) as a DTensor of ``template``'s mesh, placements and global shape, on its device,
    where ``template`` is a DTensor and ``shard`` a plain tensor; ``shard`` as it is otherwise. ``copy``: a tensor of
    its own either way, made in the one move (a copy before moving it to a GPU would be a second)."""
    if not isinstance(shard, torch.Tensor):
        return shard
    dtensor = sys.modules.get("torch.distributed.tensor")  # looked up: no DTensor exists before it is imported
    if dtensor is None or not isinstance(template, dtensor.DTensor):
        return shard.clone() if copy else shard
    return dtensor.DTensor.from_local(
        shard.to(template.to_local().device, copy=copy),
        template.device_mesh,
        template.placements,
        run_check=False,  # every rank's shard came from its counterpart: no collective to check them
        shape=template.shape,
        stride=template.stride(),
    )


@dataclass
class ModelShards(Stateful):
    """A model's Stateful (``checkpoint.state.ModelState``), sent as shards and loaded through it as DTensors."""

    model_state: Stateful

    def state_dict(self) -> dict[str, Any]:
        return as_shards(self.model_state.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        current = self.model_state.state_dict()
        self.model_state.load_state_dict(
            {name: laid_out_as(value, current.get(name)) for name, value in state_dict.items()}
        )


@dataclass
class SameLayoutOptimizerState(Stateful):
    """The optimizer's own state dict (moments keyed by parameter position, as shards), for a peer whose optimizer
    was built by the same config on the same layout: a replica group healing from a live one.

    DCP's set_optimizer_state_dict first creates the state it loads into by an optimizer step on zero gradients.
    In a restarted process that step is cold (DTensor works out the sharding of each of the optimizer's ops anew:
    about 0.13 s with foreach, half with the fused kernel) and the first real step was as cold again, while every
    live group waited. The optimizer's own load_state_dict fills an empty optimizer directly, leaving one cold
    step. Only checkpoints, which a resume may read into another layout, need the parameter names DCP keys the
    state by."""

    optimizer: torch.optim.Optimizer

    def state_dict(self) -> dict[str, Any]:
        return as_shards(self.optimizer.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Each moment becomes a DTensor cut as its parameter is, a copy: load_state_dict keeps tensors of the right
        # dtype and device as they are, and these were read straight out of the received bytes (read-only, and not
        # aligned as torch allocates), which every step would then update in place.
        parameters = [parameter for group in self.optimizer.param_groups for parameter in group["params"]]
        copied = {
            index: {
                key: laid_out_as(value, parameters[index], copy=True) if _is_moment(value) else value
                for key, value in entry.items()
            }
            for index, entry in state_dict["state"].items()
        }
        self.optimizer.load_state_dict({**state_dict, "state": copied})


def _is_moment(value: Any) -> bool:
    """A tensor the size of its parameter's shard; the step count is a scalar tensor, kept as it came."""
    return isinstance(value, torch.Tensor) and value.ndim > 0
