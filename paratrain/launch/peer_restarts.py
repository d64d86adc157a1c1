"""Multi-node restarts that reach every node: a worker ends when a peer on another node has restarted.

paratrain's multi-node runs use torchrun's static rendezvous, where each node's agent restarts only its
own workers, and only when one of them fails. A worker that dies on node 1 is restarted there, while
node 0's workers may go on waiting for it: in a collective that does not notice a lost peer (NCCL until
its timeout), or in a replica group's torchft quorum, which waits for every rank of the group. The
restarted worker waits for them in turn, in the next attempt's store, and the job stalls.

So each worker marks its attempt in the agent's store (shared by every node for the whole job) and
watches for the next one. A worker that sees a newer attempt exits, its agent restarts it into that
attempt, and every node's attempt number stays the same (one restart each), as after a failure on all
of them.

The watching thread is a daemon (it must not keep a finished worker alive), and it spends its time in the
store's C++ calls, which release the GIL. A daemon thread that takes the GIL back while the interpreter
finalizes is ended by CPython through a forced unwind, which a C++ frame turns into ``std::terminate``: the
worker aborted after its last checkpoint ("terminate called without an active exception", exit 134). So an
exit hook stops the thread and waits for its store call before the interpreter finalizes.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import threading

import torch.distributed as dist

from paratrain.errors import EXIT_PEER_RESTARTED

logger = logging.getLogger("paratrain")

POLL_S = 1.0
# How long an exiting worker waits for the watching thread's store call to return: one round trip to
# the agent, or an error at once when the agent is gone.
STOP_WAIT_S = 10.0
_KEY = "paratrain/attempt_started/{attempt}"


def maybe_follow_peer_restarts(timeout: datetime.timedelta) -> None:
    """``follow_peer_restarts`` on a client of the agent's store of its own (the watching thread polls while the
    main thread uses the other), when the job spans several nodes, each with its own agent."""
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
        follow_peer_restarts(store, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def follow_peer_restarts(store: dist.Store, attempt: int) -> None:
    """Marks ``attempt`` as started, then ends this process once any worker has started ``attempt + 1``.

    Args:
        store: The agent's store, without a prefix (every node's workers see the same keys).
        attempt: This worker's ``TORCHELASTIC_RESTART_COUNT``.
    """
    store.set(_KEY.format(attempt=attempt), str(os.getpid()))
    newer = _KEY.format(attempt=attempt + 1)
    stop = threading.Event()
    watcher = threading.Thread(
        target=_exit_once_set, args=(store, newer, stop), name="paratrain-peer-restarts", daemon=True
    )
    watcher.start()
    atexit.register(_stop_watching, stop, watcher)


def _stop_watching(stop: threading.Event, watcher: threading.Thread) -> None:
    stop.set()
    watcher.join(timeout=STOP_WAIT_S)


def _exit_once_set(store: dist.Store, key: str, stop: threading.Event) -> None:
    try:
        while not store.check([key]):
            if stop.wait(POLL_S):
                return
    except RuntimeError:  # DistStoreError: node 0's launcher is gone (the job ended, or node 0 failed)
        return
    logger.error("a worker on another node restarted: this worker ends so that torchrun restarts it beside it")
    # os._exit: the main thread may be inside a collective or a quorum that no exception reaches.
    os._exit(EXIT_PEER_RESTARTED)
