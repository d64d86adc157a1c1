"""Models for the model-contract tests, importable by a config's model.factory."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.models.plan_derivation import ParallelPlan


class MisspeltMLP(nn.Module):
    """A small MLP whose author meant to give paratrain its plan and initialisation, with both names misspelt."""

    def __init__(self, in_features: int, hidden_features: int, out_features: int):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_features, hidden_features), nn.ReLU(), nn.Linear(hidden_features, out_features)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def paralel_plan(self) -> ParallelPlan:  # one letter dropped
        return ParallelPlan(pipeline_sequence=("layers",))

    def init_parameters(self, name: str, tensor: torch.Tensor, generator: torch.Generator | None) -> None:  # one added
        nn.init.normal_(tensor, std=0.02, generator=generator)

    def flops_per_tok(self, seq_len: int) -> float:  # two letters away: a name of its own, not a typo
        return 1.0


def build_misspelt_mlp(*, in_features: int = 4, hidden_features: int = 8, out_features: int = 1) -> nn.Module:
    return MisspeltMLP(in_features, hidden_features, out_features)


class CountedSequential(nn.Sequential):
    """An nn.Sequential that states its training FLOPs per sample."""

    def flops_per_sample(self) -> float:
        return 1234.0
