"""The torchft process group replica groups use, reconfigured as a restarted lighthouse reconfigures it: two
ranks in threads of this process, on a real TCPStore and gloo."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.harness import free_loopback_port

torchft = pytest.importorskip("torchft", reason="replica groups need the ft extra: pip install 'paratrain[ft]'")

from paratrain.launch.torchft_adapters import remembering_quorum_members  # noqa: E402


def configure_and_sum(groups: list, store: str, quorum_id: int, quorum_step: int) -> list[float]:
    """Each rank configures its group for one quorum of both ranks, then all-reduces its rank + 1. Rank 1
    comes a moment later, so rank 0 reads whatever the store holds for it before it writes its own."""

    def one_rank(rank: int) -> float:
        time.sleep(rank * 0.5)
        group = groups[rank]
        group.quorum_step = quorum_step
        group.configure(store, f"paratrain_{rank}", rank, 2, quorum_id, 0, 1, [0, 1])
        tensor = torch.tensor([rank + 1.0])
        group.allreduce([tensor], dist.AllreduceOptions()).wait()
        return tensor.item()

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one_rank, range(2)))


def test_a_restarted_lighthouses_quorum_ids_name_fresh_rendezvous_in_the_same_store():
    """A new lighthouse counts quorum ids from 1 again, and the store (the primary group's) outlives it: the
    reused id's rendezvous keys still name the first quorum's process groups, closed when the ranks
    reconfigured. With the quorum's step in the prefix the new quorum meets on its own keys."""
    port = free_loopback_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    group_class = remembering_quorum_members(torchft.ProcessGroupGloo)
    groups = [group_class(timeout=timedelta(seconds=5)) for _ in range(2)]
    try:
        prefix = f"127.0.0.1:{port}/torchft"
        assert configure_and_sum(groups, f"{prefix}/1/0", quorum_id=1, quorum_step=0) == [3.0, 3.0]
        assert configure_and_sum(groups, f"{prefix}/2/0", quorum_id=2, quorum_step=4) == [3.0, 3.0]
        # The lighthouse restarted after step 6: its first quorum is id 1 again.
        assert configure_and_sum(groups, f"{prefix}/1/0", quorum_id=1, quorum_step=6) == [3.0, 3.0]
    finally:
        for group in groups:
            group.abort(errored=False)
        del server
