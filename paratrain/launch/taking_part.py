"""Which replica groups take part in a step: the quorum's members, less those healing in it.

torchft's quorum forms while the groups compute their own slices (its asynchronous quorum). A group behind the
newest step (restarted, or one whose commit failed where the others' succeeded) heals in that quorum from a live
peer, and torchft counts it out of that one step: it divides the all-reduce by the groups at the newest step and
sends zeros for the healing one. Who takes over which missing slice (``launch/group_shares.py``) must follow the
groups that take part, which torchft does not name: it gives their count alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def participating_groups(
    manager: Any,
    members: tuple[int, ...],
    *,
    group: int,
    replica_groups: int,
    device: torch.device,
    on_failure: Callable[[], None],
) -> list[int]:
    """The groups of the quorum ``members`` that take part in the step, alike on every rank of every group.

    Where torchft counts every member in, they are the members; otherwise (a group heals in this quorum) every
    group all-reduces a mark per group taking part, the healing one's zeroed by torchft. That all-reduce is asked of
    every group of the quorum alike, since whether the counts differ is the quorum's to say, not the group's.

    Args:
        manager: This rank's torchft Manager, its quorum formed.
        members: The quorum's groups (``process_group.quorum_members``).
        on_failure: Called where this rank's cross-group all-reduce failed (to close its connections).
    """
    if manager.num_participants() == len(members):
        return list(members)
    marks = torch.zeros(replica_groups, device=device)
    marks[group] = 1.0
    manager.allreduce(marks, reduce_op=dist.ReduceOp.SUM).wait()
    if failed_on_any_rank_of_the_group(manager, device=device, on_failure=on_failure):
        return list(members)  # the step commits nowhere in this group: every rank plans from the quorum alike
    return [index for index, mark in enumerate(marks.tolist()) if mark > 0.5]


def failed_on_any_rank_of_the_group(manager: Any, *, device: torch.device, on_failure: Callable[[], None]) -> bool:
    """Whether a rank of this group saw its cross-group all-reduce fail (its marks are then its own alone). The
    group's ranks must plan alike: a rank computing a slice more than another would pair its fully_shard collectives
    with the other's next ones, which gloo ends with an abort (seen: a rank whose peer group died in the quorum)."""
    failed = manager.errored() is not None
    if failed:
        on_failure()
    if dist.is_initialized() and dist.get_world_size() > 1:  # the group's own process group
        flag = torch.tensor([float(failed)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = flag.item() > 0
    return failed
