"""The torchft process group replica groups use, reconfigured as a restarted lighthouse reconfigures it: two
ranks in threads of this process, on a real TCPStore and gloo."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.harness import free_loopback_port

REPO = Path(__file__).resolve().parents[2]
torchft = pytest.importorskip("torchft", reason="replica groups need the ft extra: pip install 'paratrain[ft]'")

from paratrain.launch.torchft_adapters import connecting_within, remembering_quorum_members  # noqa: E402


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


def test_ranks_give_up_connecting_after_the_rendezvous_timeout_and_keep_the_collective_timeout():
    """A quorum member that never connects (it died after joining) fails the live rank's configure after the
    rendezvous timeout, not the collective one; once connected, a collective waits as long as the collective
    timeout allows (rank 1 comes to the all-reduce later than the rendezvous timeout)."""
    port = free_loopback_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    group_class = remembering_quorum_members(connecting_within(torchft.ProcessGroupGloo, timedelta(seconds=0.5)))
    groups = [group_class(timeout=timedelta(seconds=30)) for _ in range(2)]
    prefix = f"127.0.0.1:{port}/torchft"
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="did not all connect within .*rendezvous_timeout_s=0.5 s"):
            groups[0].configure(f"{prefix}/1/0", "paratrain_0", 0, 2, 1, 0, 1, [0, 1])
        assert time.monotonic() - started < 10

        def late_rank(rank: int) -> float:
            group = groups[rank]
            group.quorum_step = 1
            group.configure(f"{prefix}/2/0", f"paratrain_{rank}", rank, 2, 2, 0, 1, [0, 1])
            time.sleep(rank * 1.5)  # three rendezvous timeouts
            tensor = torch.tensor([rank + 1.0])
            group.allreduce([tensor], dist.AllreduceOptions()).wait()
            return tensor.item()

        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(late_rank, range(2))) == [3.0, 3.0]
    finally:
        for group in groups:
            group.abort(errored=False)
        del server


def test_a_quorum_request_under_way_hands_back_its_result_or_error_and_never_keeps_the_process_alive():
    """The step's quorum request runs while the group computes its own slice; a step that fails meanwhile (a peer
    died) ends the process, which must not wait for the request (up to quorum_timeout_s) as it waited for torchft's
    executor thread."""
    from paratrain.launch.torchft_adapters import DaemonThreadPerCall

    calls = DaemonThreadPerCall()
    assert calls.submit(lambda a, b: a + b, 2, b=3).result(timeout=5) == 5
    with pytest.raises(TimeoutError, match="lighthouse"):
        calls.submit(_raise, TimeoutError("lighthouse gone")).result(timeout=5)
    script = (
        "import time\n"
        "from paratrain.launch.torchft_adapters import DaemonThreadPerCall\n"
        "DaemonThreadPerCall().submit(time.sleep, 600)\n"
        "raise SystemExit(3)\n"
    )
    started = time.monotonic()
    ended = subprocess.run([sys.executable, "-c", script], cwd=REPO, timeout=60)
    assert ended.returncode == 3 and time.monotonic() - started < 30


def _raise(error: Exception) -> None:
    raise error
