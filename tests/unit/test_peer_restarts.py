"""A worker of a multi-node job ends once a peer on another node has started a newer attempt, and only then."""

from __future__ import annotations

import subprocess
import sys
import time

from paratrain.errors import EXIT_PEER_RESTARTED
from paratrain.launch.rendezvous import LOOPBACK_ADDR, loopback_tcp_store

# A worker of attempt 0 that follows its peers, then idles as a worker waiting in a collective would.
WORKER = """
import sys, time
import torch.distributed as dist
from paratrain.launch.peer_restarts import follow_peer_restarts
follow_peer_restarts(dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False), 0)
print("following", flush=True)
time.sleep(60)
"""


def test_a_worker_ends_when_a_newer_attempt_starts_and_not_before():
    store = loopback_tcp_store()
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, LOOPBACK_ADDR, str(store.port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout.readline() == "following\n"
        assert store.check(["paratrain/attempt_started/0"])  # its own attempt, for the others to follow
        time.sleep(2.5)  # a few polls with no newer attempt: it keeps running
        assert worker.poll() is None
        store.set("paratrain/attempt_started/1", "a restarted peer")
        assert worker.wait(timeout=30) == EXIT_PEER_RESTARTED
        assert "a worker on another node restarted" in worker.stderr.read()
    finally:
        worker.kill()


# A worker that finishes while its watching thread polls without pause, so that the thread is in a store call
# (C++, the GIL released) as the interpreter finalizes.
FINISHING_WORKER = """
import sys, time
import torch.distributed as dist
from paratrain.launch import peer_restarts
peer_restarts.POLL_S = 0
peer_restarts.follow_peer_restarts(dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False), 0)
time.sleep(0.5)
"""


def test_a_worker_that_finishes_while_following_exits_cleanly():
    """Without the exit hook that stops the watching thread, about half of such workers aborted in the
    interpreter's teardown ("terminate called without an active exception", exit 134): three at once
    catch that almost always."""
    store = loopback_tcp_store()
    argv = [sys.executable, "-c", FINISHING_WORKER, LOOPBACK_ADDR, str(store.port)]
    workers = [subprocess.Popen(argv, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        for worker in workers:
            _, stderr = worker.communicate(timeout=60)
            assert (worker.returncode, stderr) == (0, "")
    finally:
        for worker in workers:
            worker.kill()
