"""A DataLoader over the resumable order that hands the trainer one step's micro-batches at a time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from paratrain.data.sampler import DataPosition, GlobalBatchSampler


class _MicroBatchIndices:
    """Adapts the sampler's endless generator to DataLoader's batch_sampler argument."""

    def __init__(self, sampler: GlobalBatchSampler, start: DataPosition):
        self.sampler = sampler
        self.start = DataPosition(start.epoch, start.batch_in_epoch)

    def __iter__(self) -> Iterator[list[int]]:
        return self.sampler.iter_micro_batches(self.start)


class StepBatches:
    """Iterates lists of ``accumulation_steps`` collated micro-batches, one list per optimizer step."""

    def __init__(
        self,
        dataset: Dataset,
        sampler: GlobalBatchSampler,
        *,
        start: DataPosition,
        num_workers: int,
        pin_memory: bool,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
    ):
        self.sampler = sampler
        loader = DataLoader(
            dataset,
            batch_sampler=_MicroBatchIndices(sampler, start),
            num_workers=num_workers,
            pin_memory=pin_memory,
            # Worker options are refused by DataLoader without workers (the config warns instead).
            prefetch_factor=prefetch_factor if num_workers else None,
            persistent_workers=persistent_workers and num_workers > 0,
            # Workers seeded from the data position keep any per-worker randomness resumable.
            generator=torch.Generator().manual_seed(sampler.seed + start.epoch),
        )
        self._micro_batches = iter(loader)

    def __iter__(self) -> Iterator[list[Any]]:
        return self

    def __next__(self) -> list[Any]:
        return [next(self._micro_batches) for _ in range(self.sampler.accumulation_steps)]
