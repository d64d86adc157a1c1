"""Every rank of a replica group heals as it starts, or none does.

torchft heals each rank of a starting group from its counterpart in a live group, and each rank configures its
own cross-group process group for the quorum. When a peer group dies in that quorum, the ranks that were to
reach it fail (their configure times out) while the others heal. A healed rank takes its first step in that
quorum (``ReplicaGroupSync.heals_instead_of_resuming``); a rank that did not asks for the next one. Each then
waits for the other: the healed rank inside the step's collectives, the other for a quorum its group never
joins (seen in the chaos benchmark: a restarted group stuck until ``lighthouse_wait_s``, and every other group
waiting out the lighthouse's join timeout on each quorum meanwhile). Once per start, each rank writes whether it
healed to the group's torchrun store and reads every rank's; on a split the group stops and its restart heals
every rank.

The exchange is one key per rank in the store, not a collective of the group's process group. A gloo
all-reduce was tried first; the abort at exit that it was then blamed for came from the peer-restart
watcher's thread (``paratrain.launch.peer_restarts``), fixed since.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from paratrain.errors import IncompleteHeal
from paratrain.launch.process_group import attempt_store


def heal_store(timeout: timedelta) -> dist.Store | None:
    """The group's torchrun store under this attempt's prefix (``attempt_store``: a multi-node torchrun keeps its
    first store across restarts), its waits bounded by ``timeout``; None for a group of one process, which has
    nothing to agree on."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.PrefixStore("heal_agreement/", attempt_store(timeout))


def healed_ranks(healed: bool, *, store: dist.Store, rank: int, ranks: int) -> int:
    """How many of the group's ``ranks`` healed: each rank writes its own key, then waits (the store's timeout)
    for every rank's."""
    store.set(str(rank), "1" if healed else "0")
    keys = [str(other) for other in range(ranks)]
    store.wait(keys)
    return sum(int(store.get(key)) for key in keys)


def check_every_rank_healed_alike(healed: bool, *, store: dist.Store | None, rank: int, group: int) -> None:
    """Raises IncompleteHeal on every rank of a group where some ranks healed and others did not."""
    if store is None:
        return
    ranks = dist.get_world_size()
    count = healed_ranks(healed, store=store, rank=rank, ranks=ranks)
    if 0 < count < ranks:
        raise IncompleteHeal(group=group, healed=count, ranks=ranks)
