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


def completion_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each sequence's summed log-probability of its target tokens: ``(batch, 2 x L, vocab)`` logits of
    (chosen, rejected) pairs against ``(batch, 2 x L)`` labels -> ``(batch, 2)``. Labels are aligned with the
    logits that predict them (already shifted); ``IGNORE_INDEX`` counts nothing."""
    kept = labels != IGNORE_INDEX
    per_token = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    per_token = torch.where(kept, per_token, 0.0)
    return per_token.reshape(labels.shape[0], 2, -1).sum(dim=-1)


class DPOLoss:
    """The DPO objective (Rafailov et al. 2023) as TRL's DPOTrainer computes its sigmoid loss: for each pair,
    ``-log σ(β Δ)`` (``1 - label_smoothing`` of it, plus ``label_smoothing`` of ``-log σ(-β Δ)``: the
    conservative DPO of TRL), with ``Δ = (log π(chosen) - log π_ref(chosen)) - (log π(rejected) - log π_ref(rejected))``,
    averaged over the pairs. Targets are a preference dataset's ``{labels, reference}`` (data/preference.py).

    It keeps the step's reward statistics under TRL's names (``window_metrics``), for the log.
    """

    def __init__(self, *, beta: float, label_smoothing: float):
        self.beta, self.label_smoothing = beta, label_smoothing
        self.sums: dict[str, torch.Tensor] = {}
        self.pairs = 0

    def __call__(self, outputs, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        logps = completion_log_probs(getattr(outputs, "logits", outputs), targets["labels"])
        ratios = logps - targets["reference"].to(logps)  # (pairs, 2): chosen and rejected against the reference
        delta = self.beta * (ratios[:, 0] - ratios[:, 1])
        losses = -F.logsigmoid(delta) * (1 - self.label_smoothing) - F.logsigmoid(-delta) * self.label_smoothing
        self._keep(logps.detach(), self.beta * ratios.detach())
        return losses.mean() + model_aux_loss(outputs)

    def _keep(self, logps: torch.Tensor, rewards: torch.Tensor) -> None:
        values = {
            "rewards/chosen": rewards[:, 0],
            "rewards/rejected": rewards[:, 1],
            "rewards/margins": rewards[:, 0] - rewards[:, 1],
            "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).float(),
            "logps/chosen": logps[:, 0],
            "logps/rejected": logps[:, 1],
        }
        for name, value in values.items():
            self.sums[name] = self.sums.get(name, 0.0) + value.sum()
        self.pairs += logps.shape[0]

    def window_metrics(self) -> tuple[dict[str, torch.Tensor], int]:
        """The sums of each statistic over the pairs since the last call, and their number; then starts over."""
        sums, pairs = self.sums, self.pairs
        self.sums, self.pairs = {}, 0
        return sums, pairs


def dpo(*, beta: float = 0.1, label_smoothing: float = 0.0) -> DPOLoss:
    """Direct preference optimisation (``loss.factory: paratrain.losses:dpo``) on preference data
    (``data.factory: paratrain.data.preference:preference_data``): see DPOLoss.

    Args:
        beta: How far the model may move from the reference (TRL's ``beta``).
        label_smoothing: The share of each pair taken as possibly mislabelled (TRL's conservative DPO); 0: plain DPO.
    """
    if beta <= 0 or not 0 <= label_smoothing < 0.5:
        raise ValueError(f"loss.args: beta={beta} must be above 0 and label_smoothing={label_smoothing} in [0, 0.5)")
    return DPOLoss(beta=beta, label_smoothing=label_smoothing)
