"""paratrain's single-node rendezvous for torchrun: torch's c10d rendezvous without the random pause it takes to
spread many nodes' first requests."""

from __future__ import annotations

import contextlib
import inspect

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous

from paratrain.launch import rendezvous
from paratrain.launch.rendezvous import BACKEND_NAME, LOOPBACK_ADDR, _create_handler


def test_a_launch_and_its_restart_rendezvous_without_the_random_pause_and_keep_the_fixed_ones(monkeypatch):
    pauses = []

    def recorded(seconds):
        pauses.append(seconds)

    monkeypatch.setattr(dynamic_rendezvous, "_delay", recorded)
    parameters = RendezvousParameters(
        backend=BACKEND_NAME,
        endpoint=f"{LOOPBACK_ADDR}:0",
        run_id="launch",
        min_nodes=1,
        max_nodes=1,
        local_addr=LOOPBACK_ADDR,
    )
    handler = _create_handler(parameters)
    try:
        for _ in ("launch", "restart"):
            info = handler.next_rendezvous()
            assert (info.rank, info.world_size) == (0, 1)
    finally:
        handler.shutdown()
    assert not [pause for pause in pauses if isinstance(pause, tuple)]  # torch's own handler pauses (0, 0.3)
    assert dynamic_rendezvous._delay is recorded  # put back: the fixed pause between polls stays torch's


def recorded_event_names(run_id: str) -> list[str]:
    """The names of the events one launch's rendezvous records, in order."""
    names = []
    real_construct = dynamic_rendezvous.construct_and_record_rdzv_event

    def record(**event):
        names.append(event["name"])
        return real_construct(**event)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dynamic_rendezvous, "construct_and_record_rdzv_event", record)
        handler = _create_handler(
            RendezvousParameters(
                backend=BACKEND_NAME,
                endpoint=f"{LOOPBACK_ADDR}:0",
                run_id=run_id,
                min_nodes=1,
                max_nodes=1,
                local_addr=LOOPBACK_ADDR,
            )
        )
        handler.next_rendezvous()
    return names


def test_a_rendezvous_names_its_events_as_torch_does_without_inspecting_the_stack(monkeypatch):
    def no_stack(*args, **kwargs):
        raise AssertionError("inspect.stack() called during paratrain's rendezvous")

    with monkeypatch.context() as inside:
        inside.setattr(inspect, "stack", no_stack)
        ours = recorded_event_names("ours")
    assert dynamic_rendezvous.get_method_name.__module__ == dynamic_rendezvous.__name__  # torch's, put back
    monkeypatch.setattr(rendezvous, "_method_names_from_frames", contextlib.nullcontext)  # torch's own naming
    torchs = recorded_event_names("torchs")
    assert ours == torchs
    assert any(name.endswith(".next_rendezvous") for name in ours)
