"""Forward and backward over one step's micro-batches.

The trainer's step asks an engine for ``forward_backward(micro_batches)`` and never looks inside, so a
pipeline schedule (which runs all micro-batches through its stages itself) can take this engine's
place without the loop changing.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from paratrain.losses import LossFn
from paratrain.parallel.fsdp import set_gradient_sync
from paratrain.parallel.sequence_sharding import SequenceSharding
from paratrain.parallel.target_tokens import count_targets, micro_batch_weights
from paratrain.precision import MixedPrecision
from paratrain.tensors import move_to, output_device


class Engine(Protocol):
    def forward_backward(self, micro_batches: list[Any]) -> torch.Tensor:
        """Accumulates the step's gradients; returns this rank's mean loss (detached)."""

    def flush(self) -> None:
        """Writes whatever the engine recorded; called when training stops."""


class MicroBatchEngine:
    """Gradient accumulation over micro-batches for layouts where each rank holds whole layers.

    Each micro-batch's mean loss is weighted by its share of the global batch's target tokens (see
    parallel.target_tokens), so the accumulated gradient is the gradient of the mean loss over every
    target token of the step, whatever the accumulation and data-parallel size. Gradients are
    synchronised across data-parallel ranks only on the last micro-batch, unless
    sync_every_micro_batch (FSDP's memory-saving policy: reduce-scatter as you go). Under context parallel
    or document masking (``sequence``), each micro-batch is cut to this rank's tokens first, and its masks
    are kept until its backward (which recomputes attention under activation checkpointing) is done.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        precision: MixedPrecision,
        *,
        device: torch.device,
        sync_every_micro_batch: bool = False,
        sequence: SequenceSharding | None = None,
        loss_group: ProcessGroup | None = None,
        loss_ranks: int = 1,
    ):
        self.sequence = sequence
        self.loss_group, self.loss_ranks = loss_group, loss_ranks
        self.model = model
        self.loss_fn = loss_fn
        self.precision = precision
        self.device = device
        self.sync_every_micro_batch = sync_every_micro_batch

    def forward_backward(self, micro_batches: list[Any]) -> torch.Tensor:
        weights = self._weights(micro_batches)
        uniform = all(weight == 1.0 / len(micro_batches) for weight in weights)
        total = torch.zeros((), device=self.device)
        for index, ((inputs, targets), weight) in enumerate(zip(micro_batches, weights, strict=True)):
            last = index == len(micro_batches) - 1
            with self._gradient_sync(enabled=last):
                loss = self._forward_backward_one(inputs, targets, weight=weight)
            # model_parallel: the loss is on the last part's device
            total += loss.to(total.device) if uniform else loss.to(total.device) * weight
        # Uniform weights keep today's sum-then-divide order, so full-length pretraining's logged loss is unchanged.
        return total / len(micro_batches) if uniform else total

    def _weights(self, micro_batches: list[Any]) -> list[float]:
        """Each micro-batch's share of the global batch's target tokens, times the averaging ranks."""
        counts = []
        for _, targets in micro_batches:
            if self.sequence is not None and isinstance(targets, torch.Tensor):
                targets = self.sequence.local_targets(targets)
            counts.append(count_targets(targets))
        return micro_batch_weights(counts, group=self.loss_group, ranks=self.loss_ranks, device=self.device)

    def flush(self) -> None:
        """Nothing is recorded here."""

    def _forward_backward_one(self, inputs: Any, targets: Any, *, weight: float) -> torch.Tensor:
        inputs, targets = move_to(inputs, self.device), move_to(targets, self.device)
        if self.sequence is not None:
            inputs, targets = self.sequence.shard(inputs, targets)
        with self.precision.autocast():
            outputs = self.model(inputs)
            loss = self.loss_fn(outputs, move_to(targets, output_device(outputs, default=self.device)))
        if weight == 0.0:  # no targets: the mean is 0/0; its gradient through a 0 weight is 0 all the same
            loss = torch.nan_to_num(loss, nan=0.0)
        self.precision.scale(loss * weight).backward()
        if self.sequence is not None:
            self.sequence.release()
        return loss.detach()

    def _gradient_sync(self, *, enabled: bool) -> contextlib.AbstractContextManager:
        enabled = enabled or self.sync_every_micro_batch
        set_gradient_sync(self.model, enabled)  # FSDP: a flag read by the next backward
        if not enabled and isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()
