"""Built-in loss factories. A loss factory returns ``loss_fn(outputs, targets) -> scalar mean``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

IGNORE_INDEX = -100
"""The label of a token left out of the loss: PyTorch's cross_entropy default, and transformers'."""


def cross_entropy() -> LossFn:
    """Token-level cross entropy for (batch, seq, vocab) logits against (batch, seq) targets. Outputs
    with a ``logits`` field (transformers' ModelOutput) are read through it, and their
    ``weighted_aux_loss`` (see ``model_aux_loss``) is added."""

    def loss_fn(outputs, targets: torch.Tensor) -> torch.Tensor:
        logits = getattr(outputs, "logits", outputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        return loss + model_aux_loss(outputs)

    return loss_fn


def model_aux_loss(outputs) -> torch.Tensor | float:
    """The auxiliary term a model's own definition adds to its training loss: the output's
    ``weighted_aux_loss`` (a mixture of experts' load-balancing loss times its coefficient: paratrain's GPT
    returns it, and models.hf adds it to transformers' MoE outputs, whose forward adds
    ``router_aux_loss_coef * aux_loss`` only to a loss computed from labels, which paratrain does not
    pass); 0 for outputs without one. A loss factory of the user's calls it to keep the model's term."""
    term = getattr(outputs, "weighted_aux_loss", None)
    return 0.0 if term is None else term.float()


def mse() -> LossFn:
    """Mean squared error, the regression examples' loss."""

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs.float(), targets)

    return loss_fn
