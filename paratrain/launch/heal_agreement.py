"""Every rank of a replica group heals as it starts, or none does.

torchft heals each rank of a starting group from its counterpart in a live group, and each rank configures its
own cross-group process group for the quorum. When a peer group dies in that quorum, the ranks that were to
reach it fail (their configure times out) while the others heal. A healed rank takes its first step in that
quorum (``ReplicaGroupSync.heals_instead_of_resuming``); a rank that did not asks for the next one. Each then
waits for the other: the healed rank inside the step's collectives, the other for a quorum its group never
joins (seen in the chaos benchmark: a restarted group stuck until ``lighthouse_wait_s``, and every other group
waiting out the lighthouse's join timeout on each quorum meanwhile). One sum over the group's own process group,
once per start, finds the split; the group then stops and its restart heals every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratrain.errors import IncompleteHeal
from paratrain.parallel.collectives import is_distributed


def healed_ranks(healed: bool, *, device: torch.device) -> int:
    """How many of this group's ranks healed: a sum over the group's own processes (every rank calls it)."""
    if not is_distributed():
        return int(healed)
    count = torch.tensor([int(healed)], dtype=torch.int32, device=device)
    dist.all_reduce(count)
    return int(count.item())


def check_every_rank_healed_alike(healed: bool, *, device: torch.device, group: int) -> None:
    """Raises IncompleteHeal on every rank of a group where some ranks healed and others did not."""
    count, ranks = healed_ranks(healed, device=device), dist.get_world_size() if is_distributed() else 1
    if 0 < count < ranks:
        raise IncompleteHeal(group=group, healed=count, ranks=ranks)
