"""The order in which samples are seen, and the position in it that checkpoints save.

The order depends only on (seed, epoch). Each step consumes one *global* batch: the next
``global_batch_size`` indices of the epoch's permutation. Data-parallel rank ``r`` of ``dp`` takes
the r-th of dp equal slices of it and cuts its slice into micro-batches. So a step sees the same
samples whatever the data-parallel size, which is what makes every layout match a single process
and lets a run resume on a different number of ranks.

A dataset that does not divide into global batches drops its last partial batch each epoch (like
``drop_last=True``): every rank runs the same number of steps, and no collective waits on a rank
that ran out of data.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from paratrain.config.schema import DataConfig
from paratrain.errors import ConfigError


@dataclass
class DataPosition:
    """How far the run has read: the epoch and the global batches already consumed in it.

    Stateful by shape (state_dict / load_state_dict), which is all DCP checks for.
    """

    epoch: int = 0
    batch_in_epoch: int = 0

    def advance(self, batches_per_epoch: int) -> None:
        self.batch_in_epoch += 1
        if self.batch_in_epoch == batches_per_epoch:
            self.epoch += 1
            self.batch_in_epoch = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.batch_in_epoch = int(state_dict["batch_in_epoch"])


@dataclass(frozen=True)
class GlobalBatchSampler:
    """Yields this data-parallel rank's micro-batches (lists of dataset indices), step after step."""

    dataset_size: int
    global_batch_size: int
    micro_batch_size: int
    dp_rank: int
    dp_size: int
    seed: int
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.global_batch_size % (self.micro_batch_size * self.dp_size):
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} is not divisible by "
                f"train.micro_batch_size={self.micro_batch_size} x data-parallel size {self.dp_size}; "
                f"use a global batch that is a multiple of {self.micro_batch_size * self.dp_size}"
            )
        if self.dataset_size < self.global_batch_size:
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} is larger than the dataset "
                f"({self.dataset_size} samples); lower it or use more data"
            )

    @property
    def batches_per_epoch(self) -> int:
        return self.dataset_size // self.global_batch_size

    @property
    def accumulation_steps(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.dataset_size)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.dataset_size, generator=generator)

    def step_micro_batches(self, order: torch.Tensor, batch_in_epoch: int) -> list[list[int]]:
        """This rank's micro-batches of global batch number batch_in_epoch of the given order."""
        per_rank = self.global_batch_size // self.dp_size
        start = batch_in_epoch * self.global_batch_size + self.dp_rank * per_rank
        mine = order[start : start + per_rank].tolist()
        return [mine[i : i + self.micro_batch_size] for i in range(0, per_rank, self.micro_batch_size)]

    def iter_micro_batches(self, start: DataPosition) -> Iterator[list[int]]:
        """Every micro-batch from the start position on, without end (epochs follow each other)."""
        epoch, batch = start.epoch, start.batch_in_epoch
        while True:
            order = self.epoch_order(epoch)
            for batch_in_epoch in range(batch, self.batches_per_epoch):
                yield from self.step_micro_batches(order, batch_in_epoch)
            epoch, batch = epoch + 1, 0


def build_sampler(
    dataset_size: int,
    options: DataConfig,
    *,
    global_batch_size: int,
    micro_batch_size: int,
    seed: int,
    dp_rank: int,
    dp_size: int,
) -> GlobalBatchSampler:
    """The sampler of ``data.shuffle`` over this rank's share of each global batch."""
    return GlobalBatchSampler(
        dataset_size=dataset_size,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        shuffle=options.shuffle,
    )
