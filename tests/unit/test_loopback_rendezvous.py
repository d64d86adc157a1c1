"""paratrain's single-node rendezvous for torchrun: torch's c10d rendezvous without the random pause it takes to
spread many nodes' first requests."""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous

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
