"""The multi-layer perceptron of the seeds' DDP tutorials (regression on 20 features)."""

from __future__ import annotations

from torch import nn

from paratrain.models.plan import ParallelPlan


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
        return ParallelPlan(blocks=tuple(f"layers.{i}" for i in range(len(self.layers))))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_mlp(*, in_features: int = 20, hidden_features: int = 64, out_features: int = 1, num_hidden_layers: int = 2) -> MLP:
    """Factory for config files: ``model.factory: paratrain.models.mlp:build_mlp``."""
    return MLP(in_features, hidden_features, out_features, num_hidden_layers)
