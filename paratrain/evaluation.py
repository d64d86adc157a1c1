"""Evaluation on a validation dataset: its mean loss, exact over the samples of all data-parallel ranks.

The validation set is read in global batches of ``eval.batch_size x data-parallel size`` samples, in
order; data-parallel rank r takes every dp-th sample of each (tensor-parallel ranks of one replica take
the same ones). Each rank adds up ``batch loss x target tokens`` (those not ``IGNORE_INDEX``); one
all-reduce of (loss sum, token count) gives the token-weighted mean, the loss one process would compute
over the same samples, also when samples hold different numbers of targets (chat data).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, default_collate

from paratrain.config.factories import call_factory
from paratrain.config.schema import EvalConfig, TrainConfig
from paratrain.errors import ConfigError
from paratrain.losses import LossFn
from paratrain.parallel.collectives import all_reduce_sum
from paratrain.parallel.dims import ParallelDims
from paratrain.parallel.sequence_sharding import SequenceSharding
from paratrain.parallel.target_tokens import count_targets
from paratrain.tensors import move_to


def check_evaluation(options: EvalConfig, dims: ParallelDims, *, has_dataset: bool = False) -> None:
    """Refuses evaluation under a pipeline layout, before training (the eval pass would need a
    forward-only pipeline schedule, which paratrain does not run)."""
    if (options.factory or has_dataset) and dims.pp > 1:
        raise ConfigError(
            f"eval.factory={options.factory!r}: evaluation is not supported with pipeline parallel "
            f"(parallel.pp={dims.pp}); remove eval.factory, or evaluate the run's checkpoints with a "
            f"single, ddp, fsdp or tp layout"
        )


def build_evaluator(
    options: EvalConfig,
    dataset: Dataset | None,
    loss_fn: LossFn,
    *,
    model: nn.Module,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager],
    dims: ParallelDims,
    train: TrainConfig,
    sequence: SequenceSharding | None = None,
) -> Evaluator | None:
    """An Evaluator over ``dataset`` (from the Python API) or eval.factory's, split over the data-parallel
    ranks of ``dims`` (its mesh set up); None when neither dataset is given."""
    if dataset is None and options.factory is None:
        return None
    dataset = dataset if dataset is not None else call_factory(options, key="eval")
    return Evaluator(
        dataset,
        loss_fn,
        options,
        model=model,
        device=device,
        autocast=autocast,
        # Each replica group evaluates the whole set itself: a group must not wait on a peer that may be dead.
        dp_rank=dims.group_dp_rank,
        dp_size=dims.group_dp,
        group=dims.batch_mesh.get_group() if dims.mesh is not None else None,
        batch_size=options.batch_size or train.micro_batch_size,
        max_steps=train.max_steps,
        sequence=sequence,
    )


class Evaluator:
    """Runs the validation pass when a step is due for it.

    Args:
        dataset: Map-style validation dataset of (inputs, targets).
        loss_fn: ``loss_fn(outputs, targets) -> mean loss`` over a batch.
        options: The ``eval`` config section.
        model: The module forward runs through (the layout's wrapper, if any).
        device: Where inputs, targets and the loss go.
        autocast: The run's autocast context factory (mixed precision).
        batch_size: Samples per forward on one rank.
        max_steps: The last step, which is always evaluated.
        sequence: The training layout's cut of sequences, when it has one: evaluation keeps each
            sequence whole on every context-parallel rank (no exchange; the same loss on each) and
            applies document masking as training does.
    """

    def __init__(
        self,
        dataset: Dataset,
        loss_fn: LossFn,
        options: EvalConfig,
        *,
        model: nn.Module,
        device: torch.device,
        autocast: Callable[[], contextlib.AbstractContextManager],
        dp_rank: int,
        dp_size: int,
        group: dist.ProcessGroup | None,
        batch_size: int,
        max_steps: int,
        sequence: SequenceSharding | None = None,
    ):
        self.sequence = sequence
        self.dataset, self.loss_fn, self.options, self.model, self.device = dataset, loss_fn, options, model, device
        self.autocast, self.dp_rank, self.dp_size = autocast, dp_rank, dp_size
        self.batch_size, self.max_steps, self.group = batch_size, max_steps, group

    def is_due(self, step: int) -> bool:
        every = self.options.every_steps
        return step == self.max_steps or bool(every and step % every == 0)

    def maybe_evaluate(self, step: int) -> dict[str, float]:
        """``{eval_loss, eval_time_s}`` when ``step`` is due for evaluation, else ``{}``."""
        if not self.is_due(step):
            return {}
        started = time.perf_counter()
        eval_loss = self.evaluate()
        return {"eval_loss": eval_loss, "eval_time_s": time.perf_counter() - started}

    @torch.no_grad()
    def evaluate(self) -> float:
        """The mean loss over the validation samples of every rank (the same value on every rank)."""
        was_training = self.model.training
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss x target tokens, target tokens
        try:
            for indices, weight in self._rank_batches():
                batch = default_collate([self.dataset[i] for i in indices])
                # On the host: no device sync. Targets that are not one tensor: by samples, as the loss cannot be read.
                tokens = count_targets(batch[1]) if isinstance(batch[1], torch.Tensor) else len(indices)
                counted = tokens * weight
                inputs, targets = move_to(batch, self.device)
                if self.sequence is not None:
                    inputs = self.sequence.whole(inputs)
                with self.autocast():
                    loss = self.loss_fn(self.model(inputs), targets)
                loss = loss.double() if counted else torch.zeros((), dtype=torch.float64, device=self.device)  # 0/0
                totals += torch.stack([loss * counted, torch.tensor(float(counted), device=self.device)])
        finally:
            self.model.train(was_training)
            if self.sequence is not None:
                self.sequence.release()
        if self.group is not None:
            all_reduce_sum(totals, group=self.group)
        loss_sum, counted = totals.tolist()
        return loss_sum / counted if counted else float("nan")

    def _rank_batches(self) -> Iterator[tuple[list[int], int]]:
        """This rank's sample indices of each global batch, with weight 1; a rank left without samples in
        the last batch still runs a forward (sharded layouts gather parameters in it), on one sample with
        weight 0."""
        size = len(self.dataset)
        step = self.batch_size * self.dp_size
        starts = range(0, size, step)
        if self.options.max_batches is not None:
            starts = starts[: self.options.max_batches]
        for start in starts:
            indices = list(range(start + self.dp_rank, min(start + step, size), self.dp_size))
            yield (indices, 1) if indices else ([start], 0)
