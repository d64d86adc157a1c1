"""What the training loop reads each step from: one step's micro-batches, and where in the data the run
stands. A map-style dataset is read in the sampler's order from a ``DataPosition``; a streamed corpus
(``StreamedTokens``) keeps its own position as it is read. The loop asks for batches and says when a step
is done; which of the two it reads stays here."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

from paratrain.config.schema import DataConfig
from paratrain.data.loader import StepBatches
from paratrain.data.sampler import DataPosition, build_sampler
from paratrain.data.stream import StreamBatches, StreamedTokens, StreamPosition


class DataFeed:
    """This rank's share of each global batch, and the position a checkpoint stores under ``data``.

    Args:
        dataset: A map-style dataset of (inputs, targets), or a ``StreamedTokens`` stream.
        data: The ``data`` section (shuffle, loader workers).
        global_batch_size: Samples per optimizer step over all data-parallel ranks.
        micro_batch_size: Samples per forward/backward on this rank.
        seed: ``train.seed``: with the epoch, it decides the sample order.
        dp_rank: This rank's index among the data-parallel ranks.
        dp_size: How many data-parallel ranks split each global batch.
        pin_memory: Pin the loader's batches (a GPU run).
    """

    def __init__(
        self,
        dataset: Dataset,
        data: DataConfig,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        seed: int,
        dp_rank: int,
        dp_size: int,
        pin_memory: bool = False,
    ):
        self.dataset, self.data = dataset, data
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size, self.pin_memory = dp_rank, dp_size, pin_memory
        self.streaming = isinstance(dataset, StreamedTokens)
        if self.streaming:  # what a stream cannot do is refused by check_streaming, before the model is built
            self.sampler = None
            self.position: DataPosition | StreamPosition = dataset.position
            self.tokens_per_sample: int | None = dataset.block_size
        else:
            self.sampler = build_sampler(
                len(dataset),
                data,
                global_batch_size=global_batch_size,
                micro_batch_size=micro_batch_size,
                seed=seed,
                dp_rank=dp_rank,
                dp_size=dp_size,
            )
            self.position = DataPosition()
            self.tokens_per_sample = tokens_per_sample(dataset)
        self._stream_batches: StreamBatches | None = None  # the stream's reader, for slices of other ranks

    @property
    def micro_batches_per_step(self) -> int:
        """This rank's micro-batches in one optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def step_batches(self) -> Iterator[list[Any]]:
        """This rank's micro-batches, one list per optimizer step, from the current position."""
        if self.streaming:
            self._stream_batches = StreamBatches(
                self.dataset,
                global_batch_size=self.global_batch_size,
                micro_batch_size=self.micro_batch_size,
                dp_rank=self.dp_rank,
                dp_size=self.dp_size,
            )
            return self._stream_batches
        return StepBatches(
            self.dataset,
            self.sampler,
            start=self.position,
            num_workers=self.data.num_workers,
            pin_memory=self.pin_memory,
            prefetch_factor=self.data.prefetch_factor,
            persistent_workers=self.data.persistent_workers,
        )

    def slice_batches(self, dp_rank: int) -> list[Any]:
        """Data-parallel reader ``dp_rank``'s micro-batches of the step being taken (the one ``step_batches``
        handed out last), exactly as that reader gets them: a replica group computing a missing group's slice
        (``parallel.fault_tolerance.batch: fixed``). Read here, in the training process, without workers."""
        if self.streaming:
            return self._stream_batches.slice_batches(dp_rank)
        sampler = replace(self.sampler, dp_rank=dp_rank)
        order = sampler.epoch_order(self.position.epoch)
        indices = sampler.step_micro_batches(order, self.position.batch_in_epoch)
        return [default_collate([self.dataset[index] for index in micro_batch]) for micro_batch in indices]

    def step_done(self) -> None:
        """Moves the position past the step just taken. A stream moved its own as it was read; a skipped
        step's batch is not read again either way."""
        if not self.streaming:
            self.position.advance(self.sampler.batches_per_epoch)

    def first_samples(self, count: int) -> list[Any]:
        """``count`` samples from the front, leaving the position where it was (for warming up a layout)."""
        if self.streaming:
            return self.dataset.peek(count)
        return [self.dataset[index] for index in range(count)]


def tokens_per_sample(dataset: Dataset) -> int | None:
    """Token count of one sample when its inputs are token ids (integer tensors), else None."""
    inputs = dataset[0][0]
    is_tokens = isinstance(inputs, torch.Tensor) and not inputs.is_floating_point()
    return inputs.numel() if is_tokens else None
