"""The engine for pipeline layouts: a torch.distributed.pipelining schedule runs the step.

It takes the trainer's place for ``forward_backward(micro_batches)``: the step's micro-batches are
joined into one batch, and the schedule splits it again into the same micro-batches along dim 0,
passing activations between ranks and running each rank's forwards and backwards in its order. The
first stage's rank feeds inputs, the last stage's rank feeds targets and computes the loss. Gradients
are divided by the number of micro-batches (``scale_grads``); each micro-batch's mean loss is weighted by
its share of the global batch's target tokens (parallel.target_tokens) times their number, which makes
them the gradient of the mean loss over every target token of the step, as one large batch would give.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from paratrain.losses import IGNORE_INDEX, LossFn
from paratrain.parallel.pipeline.recorder import TimelineRecorder
from paratrain.parallel.pipeline.schedules import PipelineShape, is_multi_stage, schedule_class
from paratrain.parallel.sequence_sharding import SequenceSharding
from paratrain.parallel.target_tokens import count_targets, global_target_count
from paratrain.tensors import move_to


class PipelineEngine:
    """Runs one rank's pipeline stages under the configured schedule.

    Args:
        stage_modules: This rank's stages (plain, DDP- or FSDP-wrapped), in stage-index order.
        stage_indices: Their indices in the whole pipeline.
        recorder: Times each forward and backward, for the measured bubble; None records nothing.
        sequence: Under context parallel, cuts each step's samples to this rank's tokens (the same
            positions for every micro-batch: document masking is refused with a pipeline).
        loss_group: Every rank whose targets count in a step's loss (all stages: each counts the same
            samples); None alone.
        loss_ranks: Their number.
    """

    def __init__(
        self,
        stage_modules: list[nn.Module],
        stage_indices: list[int],
        shape: PipelineShape,
        *,
        loss_fn: LossFn,
        group: dist.ProcessGroup,
        device: torch.device,
        recorder: TimelineRecorder | None = None,
        sequence: SequenceSharding | None = None,
        loss_group: dist.ProcessGroup | None = None,
        loss_ranks: int = 1,
    ):
        self.sequence = sequence  # context parallel: this rank's tokens of every sample
        self.stages = [
            PipelineStage(module, index, shape.num_stages, device, group=group)
            for module, index in zip(stage_modules, stage_indices, strict=True)
        ]
        self.device = device
        self.holds_first_stage = 0 in stage_indices
        self.holds_last_stage = shape.num_stages - 1 in stage_indices
        self.recorder = recorder
        if recorder is not None:
            for stage in self.stages:
                recorder.instrument(stage)
        schedule = schedule_class(shape.schedule)
        stages: Any = self.stages if is_multi_stage(shape.schedule) else self.stages[0]
        self.loss_fn, self.microbatches = loss_fn, shape.microbatches
        self.loss_group, self.loss_ranks = loss_group, loss_ranks
        self.target_scale: float | None = None  # this step's ranks x micro-batches / targets; None: uniform
        self.schedule = schedule(stages, shape.microbatches, loss_fn=self._weighted_loss, scale_grads=True)

    def forward_backward(self, micro_batches: list[Any]) -> torch.Tensor:
        """Runs the schedule over the step; returns the mean loss on the last stage's rank, else 0."""
        inputs = move_to(torch.cat([inputs for inputs, _ in micro_batches]), self.device)
        host_targets = torch.cat([targets for _, targets in micro_batches])
        self.target_scale = self._target_scale(host_targets)  # counted where the loader left them: no device sync
        targets = move_to(host_targets, self.device)
        if self.sequence is not None:
            inputs, targets = self.sequence.shard(inputs, targets)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.holds_first_stage else ()
        with self._recording():
            self.schedule.step(
                *args,
                target=targets if self.holds_last_stage else None,
                losses=losses if self.holds_last_stage else None,
            )
        if self.sequence is not None:
            self.sequence.release()
        if not self.holds_last_stage:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach() for loss in losses]).mean()

    def _target_scale(self, targets: torch.Tensor) -> float | None:
        """What a micro-batch's mean loss is multiplied by per target token it holds; None when every
        micro-batch holds as many (full-length samples: the schedule's plain mean, unchanged)."""
        if self.sequence is not None:
            targets = self.sequence.local_targets(targets)
        counts = [count_targets(part) for part in targets.tensor_split(self.microbatches)]
        ranks = self.loss_ranks
        total = global_target_count(sum(counts), group=self.loss_group, ranks=ranks, device=self.device)
        if all(count * ranks * len(counts) == total for count in counts):
            return None
        # The schedule divides by the number of micro-batches: the weight count x ranks / total is multiplied back.
        return 0.0 if total == 0 else ranks * self.microbatches / total

    def _weighted_loss(self, outputs, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(outputs, targets)
        if self.target_scale is None:
            return loss
        # A tensor: no device sync inside the schedule. No targets: the mean is 0/0 and counts 0 (a NaN of a
        # micro-batch with targets is kept, for the non-finite guard to see).
        count = (targets != IGNORE_INDEX).sum() if not targets.is_floating_point() else torch.tensor(targets.numel())
        return torch.where(count > 0, loss * (count * self.target_scale), torch.zeros_like(loss))

    def flush(self) -> None:
        """Writes the recorded timeline, if any (called when training stops)."""
        if self.recorder is not None:
            self.recorder.write()

    def _recording(self) -> contextlib.AbstractContextManager:
        return self.recorder.step() if self.recorder is not None else contextlib.nullcontext()
