"""torchft's parts as paratrain's replica groups need them (``launch/replica_groups.py``): a process group that
remembers which groups its quorum holds and rendezvous under a prefix no earlier quorum used, and a checkpoint
transport that never unpickles a peer's bytes."""

from __future__ import annotations

import contextlib
import threading
import types
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch

from paratrain.launch import faults
from paratrain.launch.heal_payload import as_one_buffer, from_one_buffer


def remembering_quorum_members(base: type) -> type:
    """torchft's process group ``base`` that remembers which replica groups the quorum it was last configured
    for holds. torchft reconfigures it whenever the quorum changes, with each member's global rank
    (``group id x group world size + group rank``, the id read off ``replica_id``'s trailing digits).

    Its rendezvous prefix also names the quorum's agreed step (``quorum_step``, set by
    ``recording_quorum_steps``): torchft names it by quorum id alone, and a restarted lighthouse counts ids
    from 1 again. A reused prefix in the primary's store still holds the dead quorum's addresses, and gloo
    connected to ports long closed, at every retry while the ids repeated, until the groups stopped with 75."""

    class QuorumMembers(base):
        quorum_members: tuple[int, ...] = ()
        quorum_step: int | None = None
        last_quorum: Any = None  # torchft's QuorumResult, set by ``recording_quorum_steps``
        configured = False

        def configure(
            self,
            store_addr: str,
            replica_id: str,
            rank: int,
            world_size: int,
            quorum_id: int | None = None,
            group_rank: int | None = None,
            group_world_size: int | None = None,
            global_ranks: list[int] | None = None,
        ) -> None:
            size = group_world_size or 1
            self.quorum_members = tuple(sorted({member // size for member in global_ranks or ()}))
            if not self.configured:  # the start-up quorum's, where a starting group heals
                self.configured = True
                faults.maybe_fail("fail_first_configure", rank=group_rank or 0)
                faults.maybe_kill_in_attempt("kill_first_configure", rank=group_rank or 0)
            super().configure(
                f"{store_addr}/step-{self.quorum_step}",
                replica_id,
                rank,
                world_size,
                quorum_id,
                group_rank,
                group_world_size,
                global_ranks,
            )

    return QuorumMembers


def connecting_within(base: type, rendezvous: timedelta) -> type:
    """torchft's gloo process group ``base``, whose ranks give up connecting to each other after ``rendezvous``
    while its collectives keep their own timeout (the one it is built with, ``timeout_s``).

    torchft gives gloo one timeout for both, so a quorum member that died after joining the quorum (killed right
    after its ranks asked for it) held the live ranks paired with its dead one in the connection set-up for all
    of ``timeout_s`` (6.2-6.5 s a kill in the chaos benchmark, with ``timeout_s`` 5 s), though every member
    connects within milliseconds of the lighthouse answering them all at once. Giving up fails that step's
    configure; torchft reports the error, the step is not committed and is retaken in the next quorum, which
    holds the dead group's restart."""

    class ConnectingWithin(base):
        def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
            collective_timeout = self._timeout
            self._timeout = min(rendezvous, collective_timeout)  # torchft builds gloo's backend with this one
            try:
                process_group = super()._create_pg(store, rank, world_size)
            except torch.distributed.DistStoreError as error:  # a peer's address never came
                raise RuntimeError(
                    f"the quorum's groups did not all connect within parallel.fault_tolerance.rendezvous_timeout_s="
                    f"{rendezvous.total_seconds():g} s (a group died after joining the quorum, or this rank was "
                    f"starved of the CPU that long): the step is retaken in a new quorum ({error})"
                ) from error
            finally:
                self._timeout = collective_timeout
            process_group._get_backend(torch.device("cpu"))._set_default_timeout(collective_timeout)
            return process_group

    return ConnectingWithin


def recording_quorum_steps(manager: Any, process_group: Any) -> None:
    """Has ``manager`` note each quorum's agreed step (its members' newest) on ``process_group`` before it
    configures it: the step tells a restarted lighthouse's quorum from its predecessor's of the same id, as a
    step is only taken under a quorum. torchft passes configure the id but not the step, so the manager's
    client is wrapped where it returns the quorum."""

    class QuorumStepRecorder:
        def __init__(self, client: Any) -> None:
            self._client = client

        def _quorum(self, *args: Any, **kwargs: Any) -> Any:
            quorum = self._client._quorum(*args, **kwargs)
            process_group.quorum_step = quorum.max_step
            process_group.last_quorum = quorum  # for ``taking_part``: who is at the newest step
            return quorum

        def __getattr__(self, name: str) -> Any:
            return getattr(self._client, name)

    manager._client = QuorumStepRecorder(manager._client)


@contextlib.contextmanager
def one_lighthouse_id_per_group(torchft: Any) -> Iterator[None]:
    """While it is open, a new torchft Manager registers with the lighthouse as ``REPLICA_ID:group``, the same id
    in every incarnation of a group, where torchft appends a fresh uuid per Manager.

    A uuid makes a restarted group a stranger: the lighthouse keeps counting the killed incarnation as healthy
    until its heartbeats lapse (``--heartbeat-timeout-ms``, 5 s by default) and holds every quorum for it, though
    the group is back within a second. Under one id the restarted group's heartbeats stand for the dead one's and
    the quorum forms as soon as it asks. What torchft's uuid guards against, a quorum whose ids look unchanged so
    that the live groups keep a process group wired to the dead processes, ``announce_restart`` prevents."""
    manager_module = torchft.manager
    real_uuid = manager_module.uuid
    manager_module.uuid = types.SimpleNamespace(uuid4=lambda: "group")
    try:
        yield
    finally:
        manager_module.uuid = real_uuid


def announce_restart(manager: Any) -> None:
    """Has ``manager``'s first quorum request report a failed commit, so that the lighthouse gives the quorum a
    new id and every group rewires its process group to this new incarnation: the lighthouse compares members by
    id alone, and under ``one_lighthouse_id_per_group`` a restarted group has its predecessor's. (torchft counts
    failed commits in this attribute and resets it at the first commit that succeeds.)"""
    manager._commit_failures = max(manager._commit_failures, 1)


def apply_received_state_now(manager: Any) -> None:
    """Applies a live peer's state received in the quorum that just formed, as torchft's synchronous quorum does,
    instead of at the step's vote (its asynchronous quorum's time): after a start-up quorum the resume decision and
    DPO's reference read the healed weights, and a group waiting for every group sees itself healed. The group still
    takes no part in this quorum's step: torchft counts a group that was behind out of it and sends zeros for it."""
    if manager._healing:
        manager._apply_pending_state_dict()
        manager._healing = False


def take_part_though_healed(manager: Any, quorum: Any) -> None:
    """Counts ``manager``'s group in the step of the ``quorum`` it healed in, as torchft's synchronous quorum counts
    a group healed before its step: for a group healed at start-up, before computing anything, with the data
    position its peer had before drawing the step's batch. torchft's asynchronous quorum counts it out (its state
    arrives while it computes), which made a live group compute its slice too: a slice more per kill."""
    manager._participating_replica_rank = quorum.replica_rank
    manager._participating_replica_world_size = quorum.replica_world_size


def quorum_requests_in_daemon_threads(manager: Any) -> None:
    """Has ``manager`` run each quorum request (and the heal that follows it) in a daemon thread of its own, where
    torchft keeps one thread in a ThreadPoolExecutor, which the interpreter joins at exit. The request is under way
    while the step's own slice is computed (``ReplicaGroupSync``): a step that fails there (a peer died) ends the
    process, which then waited for the request to time out (``quorum_timeout_s``: 360 s in a test across two
    hosts) before torchrun could restart it. torchft waits for each request before it sends the next."""
    manager._executor.shutdown(wait=False)
    manager._executor = DaemonThreadPerCall()


class DaemonThreadPerCall:
    """The part of ``concurrent.futures.Executor`` torchft's Manager uses (``submit``, ``shutdown``), each call
    run in a daemon thread of its own."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as error:  # noqa: BLE001 - handed to the caller, as an executor does
                    future.set_exception(error)

        threading.Thread(target=run, name="torchft-quorum", daemon=True).start()
        return future

    def shutdown(self, wait: bool = True) -> None:
        """Nothing to stop: a request still under way ends with the process."""


def weights_only_transport(timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, reading what a peer sends with ``weights_only=True``: torchft
    unpickles it (``weights_only=False``, for schedulers' non-tensor state); paratrain's state is tensors,
    numbers and strings, and a peer's bytes are never unpickled into objects. A state of up to 256 MB of tensors goes
    as one safetensors buffer (``launch/heal_payload.py``): read in a seventh of the time the weights_only reader took."""
    from torchft.checkpointing import _serialization, http_transport  # lazy: torchft is an optional extra

    class WeightsOnlyHTTPTransport(http_transport.HTTPTransport):
        def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
            super().send_checkpoint(dst_ranks, step, as_one_buffer(state_dict), timeout)

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
            return from_one_buffer(super().recv_checkpoint(src_rank, metadata, step, timeout))

        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as stream:
                return _serialization._streaming_load(stream, weights_only=True)

    return WeightsOnlyHTTPTransport(timeout=timeout, num_chunks=0)
