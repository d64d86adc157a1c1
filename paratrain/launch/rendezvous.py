"""A single-node rendezvous for torchrun whose stores listen on loopback only.

torch's ``TCPStore`` server binds the wildcard address whatever host it is given (pytorch#173909):
``torchrun --rdzv-endpoint 127.0.0.1:0 --local-addr 127.0.0.1`` still opens two unauthenticated
stores on every interface, the rendezvous store and the store the workers' process group shares
with the agent. Its ``master_listen_fd`` argument takes a socket bound beforehand, so this backend
binds both to 127.0.0.1 itself. The workers' collectives are pinned to the loopback interface by
``LOOPBACK_ENV``.
"""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import Iterator

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    dynamic_rendezvous,
)
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

BACKEND_NAME = "paratrain-loopback"
LOOPBACK_ADDR = "127.0.0.1"
# Gloo and NCCL otherwise listen on the address the hostname resolves to (gloo) or on the first
# non-loopback interface (NCCL); every rank of a single-node run is reachable over loopback.
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def register_loopback_rendezvous() -> None:
    """Makes ``--rdzv-backend paratrain-loopback`` available to torchrun in this process."""
    handler_registry.register(BACKEND_NAME, _create_handler)


def loopback_tcp_store(port: int = 0) -> TCPStore:
    """A TCPStore server listening on 127.0.0.1 only (``port`` 0 picks a free one)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((LOOPBACK_ADDR, port))
    bound_port = listener.getsockname()[1]
    # detach(): the store owns the descriptor from now on; the socket object must not close it.
    return TCPStore(LOOPBACK_ADDR, bound_port, is_master=True, multi_tenant=True, master_listen_fd=listener.detach())


class _LoopbackRendezvousHandler(DynamicRendezvousHandler):
    """Torch's c10d rendezvous, with the store it shares with the workers bound to loopback."""

    def get_backend(self) -> str:
        return BACKEND_NAME  # torchrun checks it against --rdzv-backend

    def next_rendezvous(self) -> RendezvousInfo:
        # A fresh workers' store for every round. Torch 2.13 keeps the first round's, so the group
        # --max-restarts starts again reads the failed attempt's keys (its peers' old addresses) and
        # cannot connect, or waits forever (pytorch#135712, fixed there by a store per retry).
        self._shared_tcp_store_server = None
        self._bootstrap_store_info = None
        with _without_start_jitter(), _method_names_from_frames():
            return super().next_rendezvous()

    # Overrides the private hook DynamicRendezvousHandler.next_rendezvous calls to create the
    # workers' store (torch 2.13); the launch test fails if a later torch stops calling it.
    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> TCPStore:
        return loopback_tcp_store(master_port)


@contextlib.contextmanager
def _without_start_jitter() -> Iterator[None]:
    """Leaves out the random pause of up to 0.3 s torch's rendezvous takes before a node joins its first round
    (``_delay((0, 0.3))``), which spreads many nodes' first requests to the store. This backend has one node,
    and the pause delayed every launch and a worker group's first restart by 0.15 s on average (measured:
    0.10-0.32 s to rendezvous for a first restart, 0.05 s for a second). The fixed pause between polls stays."""
    real_delay = dynamic_rendezvous._delay

    def fixed_delays_only(seconds: float | tuple[float, float]) -> None:
        if not isinstance(seconds, tuple):  # a (low, high) range is the jitter
            real_delay(seconds)

    dynamic_rendezvous._delay = fixed_delays_only
    try:
        yield
    finally:
        dynamic_rendezvous._delay = real_delay


@contextlib.contextmanager
def _method_names_from_frames() -> Iterator[None]:
    """Torch's rendezvous names each event it records after the method that records it, found by
    ``inspect.stack()`` (``dynamic_rendezvous.get_method_name``), twice an event. That builds every frame's
    source context and looks each frame's module up through all of ``sys.modules`` (slow where torch is
    imported: cpython#92041): 0.20 of the 0.23 s a worker group's restart spent in torchrun's agent (profiled),
    before the restarted workers could start, while every live replica group waited. The caller's frame gives
    the same name."""
    real_get_method_name = dynamic_rendezvous.get_method_name

    def caller_of_the_recorder(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name  # what inspect.stack()[depth] names, without building a stack
        except ValueError:  # a stack not that deep
            return "no_method_name"

    dynamic_rendezvous.get_method_name = caller_of_the_recorder
    try:
        yield
    finally:
        dynamic_rendezvous.get_method_name = real_get_method_name


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    if host != LOOPBACK_ADDR or params.local_addr != LOOPBACK_ADDR:
        raise ValueError(f"{BACKEND_NAME} is for single-node runs on {LOOPBACK_ADDR}, got endpoint {params.endpoint}")
    store = loopback_tcp_store(port)
    backend = C10dRendezvousBackend(store, params.run_id)
    return _LoopbackRendezvousHandler.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes, params.local_addr
    )
