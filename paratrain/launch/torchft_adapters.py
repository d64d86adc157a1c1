"""torchft's parts as paratrain's replica groups need them (``launch/replica_groups.py``): a process group that
remembers which groups its quorum holds, and a checkpoint transport that never unpickles a peer's bytes."""

from __future__ import annotations

import urllib.request
from datetime import timedelta
from typing import Any

from paratrain.launch import faults


def remembering_quorum_members(base: type) -> type:
    """torchft's process group ``base`` that remembers which replica groups the quorum it was last configured
    for holds. torchft reconfigures it whenever the quorum changes, with each member's global rank
    (``group id x group world size + group rank``, the id read off ``replica_id``'s trailing digits)."""

    class QuorumMembers(base):
        quorum_members: tuple[int, ...] = ()
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
            super().configure(
                store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks
            )

    return QuorumMembers


def weights_only_transport(timeout: timedelta) -> Any:
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
