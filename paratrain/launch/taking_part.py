"""Which replica groups take part in a step: the quorum's members, less those that heal in it while they compute.

torchft's quorum forms while the groups compute their own slices (its asynchronous quorum). A group behind the
newest step (one whose commit failed where the others' succeeded) heals in that quorum from a live peer, and
torchft counts it out of that one step, sending zeros for it: its slice was computed on its old weights. A group
restarted and healed at start-up, before computing anything, takes part (``take_part_though_healed``), unless its
data is a stream: a live peer's stream position is read after its batch is drawn. Who takes over which missing
slice (``launch/group_shares.py``) and what the summed gradients are divided by must follow the groups that take
part, which torchft does not name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def participating_groups(
    manager: Any,
    members: tuple[int, ...],
    quorum: Any,
    *,
    group: int,
    replica_groups: int,
    device: torch.device,
    on_failure: Callable[[], None],
) -> list[int]:
    """The groups of the quorum ``members`` that take part in the step, alike on every rank of every group.

    Where every member is at the newest step, they are the members; otherwise (a group heals in this quorum)
    every group all-reduces a mark per group taking part, the marks of those torchft counts out zeroed. That
    all-reduce is asked of every group of the quorum alike: whether one heals is the quorum's to say.

    Args:
        manager: This rank's torchft Manager, its quorum formed.
        members: The quorum's groups (``process_group.quorum_members``).
        quorum: The quorum torchft formed (``process_group.last_quorum``), alike on every rank of every group.
        on_failure: Called where this rank's cross-group all-reduce failed (to close its connections).
    """
    if quorum.max_world_size == quorum.replica_world_size:  # every member at the newest step
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


def average_over_groups(manager: Any, tensors: list[torch.Tensor], *, taking_part: int) -> None:
    """Replaces each tensor (gradients, the step's loss) in place by its mean over the ``taking_part`` groups
    (summed, then divided here: torchft's mean divides by its own count, which leaves out a group healed at
    start-up): one all-reduce per dtype over the tensors flattened, not one per tensor (each is a round trip)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    flat = {dtype: torch.cat([tensor.reshape(-1) for tensor in group]) for dtype, group in by_dtype.items()}
    for work in [manager.allreduce(buffer, reduce_op=dist.ReduceOp.SUM) for buffer in flat.values()]:
        work.wait()
    for dtype, group in by_dtype.items():
        for tensor, summed in zip(group, flat[dtype].split([tensor.numel() for tensor in group]), strict=True):
            tensor.copy_(summed.view_as(tensor)).div_(taking_part)
