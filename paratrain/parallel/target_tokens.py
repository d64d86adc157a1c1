"""Weights that make a step's loss the mean over the target tokens of the whole global batch.

A loss function returns the mean over one micro-batch's target tokens (those whose label is not
``IGNORE_INDEX``). Averaging those means over micro-batches and data-parallel ranks weighs a token of a
micro-batch with few targets more than one of a micro-batch with many, so gradient accumulation and the
data-parallel size would change the loss and gradients once prompts are masked out (the bug HF Trainer
shipped with accumulation until late 2024). Here each micro-batch's mean is weighted by its share of the
global batch's targets instead.

DDP and FSDP average gradients over the ``ranks`` they reduce over (data-parallel, and context-parallel
ranks under FSDP's dp_shard x cp), so the weight carries a factor ``ranks`` that their division cancels:

    weight = local_targets * ranks / global_targets

When every micro-batch holds the same number of targets (pretraining on full-length samples) this is
exactly ``1 / num_micro_batches``, today's weight, so those runs keep their numbers bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from paratrain.losses import IGNORE_INDEX


def count_targets(targets: object) -> int:
    """How many of ``targets`` count in the loss. Floating targets (a regression) all count; targets that are
    not one tensor (a user's structure, whose loss paratrain cannot read) count 1 per micro-batch, weighing
    every micro-batch alike as before."""
    if not isinstance(targets, torch.Tensor):
        return 1
    if targets.is_floating_point():
        return targets.numel()
    return int((targets != IGNORE_INDEX).sum().item())


def global_target_count(local: int, *, group: ProcessGroup | None, ranks: int, device: torch.device) -> float:
    """The sum of ``local`` over the ``group``'s ``ranks`` (one all-reduce of a number)."""
    total = torch.tensor(local, dtype=torch.float64, device=device)
    if group is not None and ranks > 1:
        dist.all_reduce(total, group=group)
    return total.item()


def micro_batch_weights(
    local_counts: list[int], *, group: ProcessGroup | None, ranks: int, device: torch.device
) -> list[float]:
    """Each micro-batch's weight for its mean loss (see the module docstring).

    Args:
        local_counts: This rank's target tokens in each of the step's micro-batches (after any
            context-parallel cut).
        group: The ranks whose gradients are averaged (data-parallel x context-parallel); None alone.
        ranks: Their number.
        device: Where the group's collectives run (NCCL reduces only GPU tensors).

    Returns:
        One weight per micro-batch; 0 for a micro-batch without targets.
    """
    global_count = global_target_count(sum(local_counts), group=group, ranks=ranks, device=device)
    if global_count == 0:  # a step without any target: nothing to learn, weights of 0 keep it finite
        return [0.0 for _ in local_counts]
    if all(count * ranks * len(local_counts) == global_count for count in local_counts):
        return [1.0 / len(local_counts)] * len(local_counts)  # exactly today's weight for full samples
    return [count * ranks / global_count for count in local_counts]
