"""Built-in loss factories. A loss factory returns ``loss_fn(outputs, targets) -> scalar mean``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy() -> LossFn:
    """Token-level cross entropy for (batch, seq, vocab) logits against (batch, seq) targets. Outputs
    with a ``logits`` field (transformers' ModelOutput) are read through it."""

    def loss_fn(outputs, targets: torch.Tensor) -> torch.Tensor:
        logits = getattr(outputs, "logits", outputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    return loss_fn


def mse() -> LossFn:
    """Mean squared error, the seeds' regression loss."""

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs.float(), targets)

    return loss_fn
