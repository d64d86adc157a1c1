"""The state a live replica group sends a healing one, as one safetensors buffer (launch/heal_payload.py)."""

from __future__ import annotations

import enum
import io

import torch
from torch.utils import _pytree as pytree

from paratrain.launch import heal_payload
from paratrain.launch.heal_payload import ONE_BUFFER, as_one_buffer, from_one_buffer


def through_the_wire(state):
    """``state`` as the transport carries it: packed, pickled, read with weights_only, unpacked."""
    stream = io.BytesIO()
    torch.save(as_one_buffer(state), stream)
    return from_one_buffer(torch.load(io.BytesIO(stream.getvalue()), weights_only=True))


def test_a_state_crosses_as_one_buffer_and_comes_back_the_same():
    tied = torch.randn(4, 3)
    state = {
        "model": {"embed": tied, "head": tied, "transposed": tied.t(), "empty": torch.empty(0)},
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, dtype=torch.bfloat16)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0], "fused": None, "name": "decay"}],
        },
        "progress": {"step": 5, "tokens": 2**40, "loss": float("inf"), "done": False},
    }
    assert list(as_one_buffer(state)) == [ONE_BUFFER]
    received = through_the_wire(state)
    sent_leaves, sent_spec = pytree.tree_flatten(state)
    got_leaves, got_spec = pytree.tree_flatten(received)
    assert got_spec == sent_spec  # the same nesting, int keys still ints, tuples still tuples
    for sent, got in zip(sent_leaves, got_leaves, strict=True):
        assert type(got) is type(sent)
        if isinstance(sent, torch.Tensor):
            assert got.dtype == sent.dtype and torch.equal(got, sent)
        else:
            assert got == sent
    received["model"]["embed"].add_(1.0)  # each received tensor is writable memory of its own
    assert not torch.equal(received["model"]["head"], received["model"]["embed"])


class Mode(enum.Enum):
    SHRINK = "shrink"


def test_a_state_json_cannot_hold_goes_as_it_is():
    for state in ({"mode": Mode.SHRINK, "w": torch.ones(2)}, {"sizes": [torch.ones(1)], "name": b"bytes"}):
        assert as_one_buffer(state) is state
        assert from_one_buffer(state) is state


def test_a_large_state_goes_as_it_is_streamed_not_copied_whole(monkeypatch):
    state = {"model": {"w": torch.ones(300), "b": torch.ones(100)}}  # 1,600 bytes of tensors
    monkeypatch.setattr(heal_payload, "ONE_BUFFER_MAX_BYTES", 1_600)
    assert list(as_one_buffer(state)) == [ONE_BUFFER]
    monkeypatch.setattr(heal_payload, "ONE_BUFFER_MAX_BYTES", 1_599)
    assert as_one_buffer(state) is state
    assert torch.equal(through_the_wire(state)["model"]["w"], state["model"]["w"])


class CopyingModelState:
    """A model's Stateful whose state dict holds copies of the weights, not the weights themselves."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: value.clone() for name, value in self.model.state_dict().items()}


def test_model_shards_are_read_once_only_where_they_are_the_weights_themselves():
    from paratrain.checkpoint.state import ModelState

    model = torch.nn.Linear(3, 2)
    shards = heal_payload.ModelShards(ModelState(model))
    assert shards.reads_weights_alone()
    with torch.no_grad():
        model.weight.add_(1.0)  # an optimizer step, in place: the shards read before show it
    assert torch.equal(shards.state_dict()["weight"], model.weight)
    copies = heal_payload.ModelShards(CopyingModelState(model))
    assert not copies.reads_weights_alone()
    with torch.no_grad():
        model.weight.add_(1.0)
    assert torch.equal(copies.state_dict()["weight"], model.weight)  # read again, not a stale copy
