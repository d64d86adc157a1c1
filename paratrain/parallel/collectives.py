"""The few collectives the trainer itself calls. Each is a no-op in a process without a group."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum of tensor over the group's ranks (in place)."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_min_max(
    values: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise minimum and maximum of a 1-D tensor over the group's ranks, in one all-reduce (max of
    the values and of their negatives)."""
    both = torch.cat([values, -values])
    if is_distributed():
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    maximum, negative_minimum = both.chunk(2)
    return -negative_minimum, maximum


def broadcast_object(obj: T, *, src: int = 0, group: dist.ProcessGroup | None = None) -> T:
    """Rank src's obj on every rank (pickled between this job's own processes only)."""
    if not is_distributed():
        return obj
    holder: list[Any] = [obj]
    dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if is_distributed():
        dist.barrier(group=group)


def all_gather_object(obj: T, *, group: dist.ProcessGroup | None = None) -> list[T]:
    """Every rank's obj, in rank order, on every rank (pickled between this job's own processes only);
    a synchronisation point like a barrier."""
    if not is_distributed():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


@contextlib.contextmanager
def quiet_single_process():
    """DCP warns on every call without a process group; a lone process has none on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
