"""What a live replica group sends a healing one, and how the healing rank loads it: the model and the optimizer
as this rank's shards (plain tensors), every group having built the same model and optimizer on the same inner
layout, so each rank's counterpart holds the same cut.

torchft's transport pickles what it is given, and the receiver reads it with ``weights_only=True``. DTensors went
as themselves, each with its mesh and placements to rebuild: reading the tests' tiny GPT's 111 of them took twice
as long as reading their shards (28 against 14 ms, two ranks on two cores under load), writing them too (9 against 4 ms),
while every live group waited. The healing rank wraps each shard in its own parameter's mesh and placements.

Even as shards, torch's weights_only reader unpickles each tensor and each number of the state one by one in
Python: 14.6 ms for that GPT's 148 tensors and 76 numbers on an idle core, and the healing rank, which every live group
waits for, finished reading 30-90 ms after the peer had sent the last byte while the live groups computed beside it.
So a state of up to 256 MB of tensors travels as one safetensors buffer (``as_one_buffer``): the tensors by
safetensors, the numbers and the nesting as JSON, read in 1.9 ms on an idle core; still no pickle of the peer's."""

from __future__ import annotations

import itertools
import json
import sys
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils import _pytree as pytree
from torch.utils._pytree import tree_map_only

from paratrain.tensors import local_part


def as_shards(state: Any) -> Any:
    """``state`` (nested dicts and lists) with each DTensor replaced by this rank's shard: the same storage."""
    with torch.no_grad():  # to_local outside autograd: the shard itself, not a view autograd tracks
        return tree_map_only(torch.Tensor, local_part, state)


# The one key of a state sent as one buffer: what the receiver tells it from a state sent as it is.
ONE_BUFFER = "paratrain_safetensors"
# The leaves other than tensors that JSON gives back as they were.
JSON_LEAVES = (int, float, str, bool, type(None))
# Above this many bytes of tensors the state goes as it is: the buffer is a copy on each side (on the receiver, one more
# while safetensors reads it), where torch's streaming writer and reader copy nothing whole; the Python cost per tensor
# that one buffer saves matters beside the bytes only for small states (the tiny GPT's: 0.2 MB).
ONE_BUFFER_MAX_BYTES = 256 * 2**20


def as_one_buffer(state: Any) -> Any:
    """``state`` (nested dicts, lists and tuples of tensors, numbers, strings and None) as ``{ONE_BUFFER: bytes as a
    uint8 tensor}``: its tensors in safetensors' format, its other leaves and its nesting as JSON in the buffer's
    metadata. A state that does not fit (over ``ONE_BUFFER_MAX_BYTES``, a leaf JSON cannot hold, a node pytree cannot
    name) is returned as it is, for the transport to pickle as before."""
    leaves, spec = pytree.tree_flatten(state)
    is_tensor = [isinstance(leaf, torch.Tensor) for leaf in leaves]
    if sum(leaf.nbytes for leaf, tensor in zip(leaves, is_tensor) if tensor) > ONE_BUFFER_MAX_BYTES:
        return state
    if not all(tensor or type(leaf) in JSON_LEAVES for leaf, tensor in zip(leaves, is_tensor)):
        return state  # JSON would turn a tuple subclass into a list, an enum into its value: not the same state
    try:
        metadata = {
            "spec": pytree.treespec_dumps(spec),
            "leaves": json.dumps([None if tensor else leaf for leaf, tensor in zip(leaves, is_tensor)]),
        }
        if pytree.treespec_loads(metadata["spec"]) != spec:  # keys JSON cannot tell apart (1 and "1", tuples)
            return state
        buffer = safetensors.torch.save(_tensors_on_the_host(leaves), metadata=metadata)
    except (TypeError, ValueError, NotImplementedError):  # a node pytree cannot name, a dtype safetensors lacks
        return state
    return {ONE_BUFFER: torch.frombuffer(bytearray(buffer), dtype=torch.uint8)}


def from_one_buffer(received: Any) -> Any:
    """The state ``as_one_buffer`` packed, its tensors each of its own memory; ``received`` as it is when it was
    sent as it is."""
    if not (isinstance(received, dict) and received.keys() == {ONE_BUFFER}):
        return received
    buffer = received[ONE_BUFFER].numpy().tobytes()
    header_length = int.from_bytes(buffer[:8], "little")  # safetensors' format: the header's length, then the header
    metadata = json.loads(buffer[8 : 8 + header_length])["__metadata__"]
    tensors = safetensors.torch.load(buffer)
    leaves = [tensors.get(str(i), leaf) for i, leaf in enumerate(json.loads(metadata["leaves"]))]
    return pytree.tree_unflatten(leaves, pytree.treespec_loads(metadata["spec"]))


def _tensors_on_the_host(leaves: list[Any]) -> dict[str, torch.Tensor]:
    """The tensor leaves by position, on the host and contiguous; a second view of a storage already taken (tied
    weights) copied, as safetensors refuses two views of one storage."""
    tensors, storages = {}, set()
    for position, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            tensor = leaf.detach().to("cpu")
            if tensor.untyped_storage().data_ptr() in storages or not tensor.is_contiguous():
                tensor = tensor.clone(memory_format=torch.contiguous_format)
            storages.add(tensor.untyped_storage().data_ptr())
            tensors[str(position)] = tensor
    return tensors


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
    weights: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shards; once seen to be the weights' own storage, the same tensors again without asking the
        model. A peer then reads them while this rank computes (its quorum overlaps its own slice), where the
        model's state_dict would have fully_shard put the sharded parameters back in the modules mid-forward. The
        optimizer updates the weights in place, and a step's all-reduce waits for the peer's read."""
        if self.weights is not None:
            return dict(self.weights)
        shards = as_shards(self.model_state.state_dict())
        if _alias_the_weights(shards, self.model_state.model):
            self.weights = shards
        return shards

    def reads_weights_alone(self) -> bool:
        """Whether ``state_dict`` returns the weights themselves (asked once, outside any forward)."""
        self.state_dict()
        return self.weights is not None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Each shard copied into this rank's own (the state dict aliases the weights), where every entry is a
        tensor cut as this rank's: DCP's set_model_state_dict, which it replaces there, took 7 of the 11 ms a heal's
        loading took on an idle core. Otherwise through it, as DTensors."""
        current = self.model_state.state_dict()
        with torch.no_grad():  # to_local outside autograd: the shard itself, as as_shards takes it
            own_parts = _own_parts_cut_alike(current, state_dict)
            if own_parts is not None:
                for mine, shard in own_parts:
                    mine.copy_(shard)
                return
        self.model_state.load_state_dict(
            {name: laid_out_as(value, current.get(name)) for name, value in state_dict.items()}
        )


def _alias_the_weights(shards: dict[str, Any], model: torch.nn.Module) -> bool:
    """Whether every entry of ``shards`` is a tensor in the storage of one of ``model``'s parameters or buffers."""
    try:
        own = {
            local_part(tensor).untyped_storage().data_ptr()
            for tensor in itertools.chain(model.parameters(), model.buffers())
        }
        return all(
            isinstance(shard, torch.Tensor) and shard.untyped_storage().data_ptr() in own for shard in shards.values()
        )
    except (RuntimeError, NotImplementedError, TypeError):  # a tensor subclass without a storage of its own
        return False


def _own_parts_cut_alike(current: dict[str, Any], received: dict[str, Any]) -> list[tuple[Any, Any]] | None:
    """(this rank's part of each entry of ``current``, the received one) where ``received`` names the same entries,
    each a tensor of its part's shape and dtype; None otherwise."""
    if current.keys() != received.keys():
        return None
    pairs = []
    for name, shard in received.items():
        if not (isinstance(shard, torch.Tensor) and isinstance(current[name], torch.Tensor)):
            return None
        mine = local_part(current[name])
        if mine.shape != shard.shape or mine.dtype != shard.dtype:
            return None
        pairs.append((mine, shard))
    return pairs


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
        # dtype and device as they are, and a state sent as it is (not one buffer) was read straight out of the
        # received bytes (read-only, and not aligned as torch allocates), which every step would then update in place.
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
