"""Fault-tolerant replica groups on torchft: the lighthouse (quorum server), the start-up check that it
answers, and each rank's side of a step across groups (``ReplicaGroupSync``).

Each replica group is its own torchrun job. Rank i of every group joins one torchft ``Manager`` per rank;
the managers agree at the start of every step on which groups are alive (the quorum, through the
lighthouse), average rank i's gradients over the live groups through torchft's gloo process group, and
commit the step only where every rank of a group succeeded. A group that died is left out of the quorum
until it is back; when it rejoins, torchft sends it a live peer's state (``state_dict`` below: model,
optimizer, scheduler, data position and step) over its checkpoint transport, so it reads no checkpoint.

torchft is an optional dependency (``pip install 'paratrain[ft]'``): imported only when groups are on.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from paratrain.config.schema import FaultToleranceConfig
from paratrain.errors import ConfigError

logger = logging.getLogger("paratrain")

INSTALL_HINT = "pip install 'paratrain[ft]'"


def lighthouse_host_port(address: str, *, key: str = "parallel.fault_tolerance.lighthouse") -> tuple[str, int]:
    """``http://HOST:PORT`` (or ``HOST:PORT``) as (HOST, PORT).

    Raises:
        ConfigError: naming ``key`` when there is no host or port.
    """
    parts = urllib.parse.urlsplit(address if "://" in address else f"http://{address}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise ConfigError(f"{key}={address!r} is not an address: write it as http://HOST:PORT")
    return parts.hostname, port


def check_lighthouse_reachable(options: FaultToleranceConfig) -> None:
    """Waits up to ``options.connect_timeout_s`` for the lighthouse to accept a connection.

    Raises:
        ConfigError: naming the address, the wait and how to start one, before anything trains.
    """
    host, port = lighthouse_host_port(options.lighthouse)
    deadline = time.monotonic() + options.connect_timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"parallel.fault_tolerance.lighthouse={options.lighthouse} did not answer within "
                    f"parallel.fault_tolerance.connect_timeout_s={options.connect_timeout_s:g} s ({error}); start "
                    f"it first with `paratrain lighthouse --bind {host}:{port}` (one for all replica groups), or "
                    f"point the key at the running one"
                ) from error
        time.sleep(0.2)


def run_lighthouse(*, bind: str, min_replicas: int, join_timeout_ms: int, heartbeat_timeout_ms: int) -> int:
    """Serves torchft's lighthouse until SIGINT or SIGTERM (``paratrain lighthouse``)."""
    lighthouse_server = _import_torchft("the lighthouse")._torchft.LighthouseServer
    lighthouse_host_port(bind, key="--bind")
    server = lighthouse_server(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    print(f"paratrain: lighthouse serving at {server.address()} (min_replicas={min_replicas})", flush=True)
    stopped = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda number, frame: stopped.append(number))
    while not stopped:
        time.sleep(0.2)
    server.shutdown()
    return 0


@dataclass
class GroupCounts:
    """What the replica groups did, for the log: carried in the healing state, so a healed group reports
    the run's totals."""

    live: int = 0  # groups in the newest step's quorum
    missing_group_steps: int = 0  # over committed steps, the groups that sat out: their shards were skipped

    def state_dict(self) -> dict[str, int]:
        return {"missing_group_steps": self.missing_group_steps}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.missing_group_steps = int(state_dict["missing_group_steps"])


class ReplicaGroupSync:
    """One rank's side of each step across replica groups: ``start_step`` (quorum, and healing from a
    peer), ``average`` (gradients and loss over the live groups), ``should_commit``.

    Args:
        manager: The rank's torchft Manager (``build_replica_group_sync`` makes it).
        replica_groups: How many groups the run has (the data is sharded over all of them).
    """

    def __init__(self, manager: Any, *, replica_groups: int, counts: GroupCounts, start_timeout_s: float):
        self.manager, self.replica_groups, self.counts = manager, replica_groups, counts
        self.start_timeout_s = start_timeout_s
        self.healed, self.started = False, False

    def start_step(self) -> bool:
        """Joins this step's quorum; True when this group was just healed from a live peer (the caller
        then reads data from the position it received)."""
        self.healed = False
        self.manager.start_quorum()
        if not self.started:
            self.started = True
            self._wait_for_every_group()
        self.counts.live = self.manager.num_participants()
        return self.healed

    def _wait_for_every_group(self) -> None:
        """At a run's first step every group is awaited (up to start_timeout_s), so that none steps alone on
        its shards while the others are still starting. A group joining a run under way (healed from a
        peer, or a quorum past step 0) waits for no one: the missing groups may be dead."""
        deadline = time.monotonic() + self.start_timeout_s
        while (
            self.manager.num_participants() < self.replica_groups
            and self.manager.current_step() == 0
            and not self.healed
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
            self.manager.start_quorum()

    def set_step(self, step: int) -> None:
        """The step a checkpoint resumed this group at, for the quorum: groups behind the newest heal from it."""
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})

    def average(self, tensors: list[torch.Tensor]) -> None:
        """Replaces each tensor (gradients, the step's loss) in place by its mean over the live groups: one
        all-reduce per dtype over the tensors flattened, not one per tensor (each is a round trip)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        flat = {dtype: torch.cat([tensor.reshape(-1) for tensor in group]) for dtype, group in by_dtype.items()}
        for work in [self.manager.allreduce(buffer) for buffer in flat.values()]:
            work.wait()
        for dtype, group in by_dtype.items():
            for tensor, averaged in zip(group, flat[dtype].split([tensor.numel() for tensor in group])):
                tensor.copy_(averaged.view_as(tensor))

    def should_commit(self) -> bool:
        """Whether every rank of every live group finished the step (torchft's vote); counts the groups that
        sat out a committed step."""
        committed = self.manager.should_commit()
        if committed:
            self.counts.missing_group_steps += self.replica_groups - self.counts.live
        return committed

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def build_replica_group_sync(
    options: FaultToleranceConfig,
    *,
    device: torch.device,
    state_dict: Callable[[], dict[str, Any]],
    load_state_dict: Callable[[dict[str, Any]], None],
    counts: GroupCounts,
) -> ReplicaGroupSync:
    """This rank's Manager, joined to the group's torchrun store (MASTER_ADDR/MASTER_PORT, RANK/WORLD_SIZE).

    Args:
        state_dict: What a recovering peer receives (every Stateful of a resume).
        load_state_dict: Applies what a live peer sent, when this group heals.
    """
    torchft = _import_torchft("replica groups")
    logging.getLogger("torchft").setLevel(logging.ERROR)  # its per-step quorum and commit notes drown the log
    timeout = timedelta(seconds=options.timeout_s)
    # gloo for CPU tensors; NCCL where the gradients live on GPUs (torchtitan's choice too).
    pg = torchft.ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else torchft.ProcessGroupGloo(timeout)
    sync: ReplicaGroupSync | None = None

    def load_and_mark(state: dict[str, Any]) -> None:
        load_state_dict(state)
        sync.healed = True

    manager = torchft.Manager(
        pg=pg,
        load_state_dict=load_and_mark,
        state_dict=state_dict,
        min_replica_size=options.min_replica_groups,
        # Synchronous quorum: healing is applied before the step's batch is read, so the data position
        # a peer sent decides that batch.
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=options.quorum_timeout_s),
        connect_timeout=timedelta(seconds=options.connect_timeout_s),
        lighthouse_addr=options.lighthouse,
        replica_id=f"paratrain_{options.replica_group}",
        checkpoint_transport=_weights_only_transport(torchft, timeout),
        # Every group builds the same initial weights from train.seed: nothing to send at step 0.
        init_sync=False,
    )
    sync = ReplicaGroupSync(
        manager, replica_groups=options.replica_groups, counts=counts, start_timeout_s=options.quorum_timeout_s
    )
    return sync


def _weights_only_transport(torchft: Any, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, reading what a peer sends with ``weights_only=True``: torchft
    unpickles it (``weights_only=False``, for schedulers' non-tensor state); paratrain's state is tensors,
    numbers and strings, and a peer's bytes are never unpickled into objects."""
    from torchft.checkpointing import _serialization, http_transport  # lazy: torchft is an optional extra

    class WeightsOnlyHTTPTransport(http_transport.HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as stream:
                return _serialization._streaming_load(stream, weights_only=True)

    return WeightsOnlyHTTPTransport(timeout=timeout, num_chunks=0)


def _import_torchft(what: str) -> Any:
    try:
        import torchft  # lazy: an optional extra, needed only when replica groups are on
    except ImportError as error:
        raise ConfigError(
            f"{what} need torchft, which is not installed: {INSTALL_HINT} (or set "
            f"parallel.fault_tolerance.replica_groups=1)"
        ) from error
    return torchft
