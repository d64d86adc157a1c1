"""The multi-layer perceptron of the classic DDP tutorials (regression on 20 features)."""

from __future__ import annotations

import math

import torch
from torch import nn

from paratrain.models.plan_derivation import ParallelPlan


class MLP(nn.Module):
    """Hidden layers of Linear + ReLU, then a linear output layer."""

    def __init__(self, in_features: int, hidden_features: int, out_features: int, num_hidden_layers: int):
        super().__init__()
        widths = [in_features] + [hidden_features] * num_hidden_layers
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(w_in, w_out), nn.ReLU()) for w_in, w_out in zip(widths, widths[1:])
        )
        self.head = nn.Linear(widths[-1], out_features)

    def parallel_plan(self) -> ParallelPlan:
        blocks = tuple(f"layers.{i}" for i in range(len(self.layers)))
        return ParallelPlan(blocks=blocks, pipeline_sequence=(*blocks, "head"))

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator | None) -> None:
        """nn.Linear's default range, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), for weights and biases."""
        layer = self.get_submodule(name.rsplit(".", 1)[0])
        bound = 1.0 / math.sqrt(layer.in_features)
        nn.init.uniform_(tensor, -bound, bound, generator=generator)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_mlp(
    *, in_features: int = 20, hidden_features: int = 64, out_features: int = 1, num_hidden_layers: int = 2
) -> MLP:
    """Factory for config files: ``model.factory: paratrain.models.mlp:build_mlp``."""
    return MLP(in_features, hidden_features, out_features, num_hidden_layers)
