"""DPO's reference log-probabilities, computed once, before the first step, by the model as it starts.

The model a DPO run starts from is its reference: a pretrained (or fine-tuned) model, or, with LoRA, its
base with adapters whose B is zero (so the adapted model is the base). Its log-probabilities of every pair's
chosen and rejected completions are computed in one pass over the preference data before training (each
data-parallel rank a share of the pairs, under the training layout, no gradients), and every pair then
carries its two numbers into the loss. So no second copy of the model is held, with or without LoRA, at
the cost of one forward pass over the data. The numbers are part of every checkpoint: a resume reads
them, since the model it resumes is no longer the reference.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from paratrain.losses import completion_log_probs
from paratrain.parallel.collectives import all_reduce_sum
from paratrain.parallel.dims import ParallelDims
from paratrain.parallel.sequence_sharding import SequenceSharding

logger = logging.getLogger("paratrain")


class PreferenceReference:
    """The reference log-probabilities of a preference dataset's pairs (its ``reference``), and their place
    in checkpoints.

    Args:
        dataset: A preference dataset (data/preference.py): pairs as (inputs, {labels, reference}).
        model: What runs a forward under the layout (the runnable model: DDP, FSDP).
        sequence: The layout's cut of each sequence, which clears the pairs' start marks and keeps each of a
            pair's two sequences to itself.
        micro_batch_size: Pairs per forward.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        model: nn.Module,
        sequence: SequenceSharding,
        autocast: Callable[[], AbstractContextManager],
        device: torch.device,
        dims: ParallelDims,
        micro_batch_size: int,
    ):
        self.dataset, self.model, self.sequence, self.autocast = dataset, model, sequence, autocast
        self.device, self.dims, self.micro_batch_size = device, dims, micro_batch_size

    def maybe_compute(self) -> None:
        """Computes every pair's reference log-probabilities unless a resumed checkpoint held them."""
        if not torch.isnan(self.dataset.reference).any():
            return
        pairs, ranks, rank = len(self.dataset), self.dims.dp, self.dims.dp_rank
        logger.info("DPO: the reference log-probabilities of %d pairs, from the model as it starts", pairs)
        computed = torch.zeros(pairs, 2, dtype=torch.float64, device=self.device)
        # Every rank runs as many forwards (FSDP's gather each one): the last ones repeat a pair, counted once.
        per_rank = math.ceil(pairs / ranks)
        mine = [min(rank + ranks * i, pairs - 1) for i in range(per_rank)]
        owned = [rank + ranks * i < pairs for i in range(per_rank)]
        training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for start in range(0, per_rank, self.micro_batch_size):
                batch = mine[start : start + self.micro_batch_size]
                logps = self._log_probs(batch)
                for index, keep, values in zip(batch, owned[start : start + self.micro_batch_size], logps, strict=True):
                    if keep:
                        computed[index] = values.double()
        self.model.train(training)
        group = self.dims.batch_mesh.get_group() if self.dims.mesh is not None and ranks > 1 else None
        self.dataset.reference.copy_(all_reduce_sum(computed, group=group).float().cpu())

    def _log_probs(self, indices: list[int]) -> torch.Tensor:
        samples = [self.dataset[index] for index in indices]
        inputs = torch.stack([inputs for inputs, _ in samples]).to(self.device)
        labels = torch.stack([targets["labels"] for _, targets in samples]).to(self.device)
        inputs = self.sequence.whole(inputs)
        try:
            with self.autocast():
                outputs = self.model(inputs)
        finally:
            self.sequence.release()
        logits = getattr(outputs, "logits", outputs)
        return completion_log_probs(logits, labels.to(logits.device))

    def checkpoint_state(self) -> dict[str, Any]:
        return {"preference_reference": self}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"logps": self.dataset.reference}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.dataset.reference.copy_(state_dict["logps"])


class NoPreferenceReference:
    """A run that is not DPO: nothing to compute, nothing in checkpoints."""

    def maybe_compute(self) -> None:
        pass

    def checkpoint_state(self) -> dict[str, Any]:
        return {}
