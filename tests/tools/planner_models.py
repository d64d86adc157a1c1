"""Models the planner must refuse: one whose size is unknown until its first forward, one with no parameters;
and models it must plan: one whose forward cannot run on the meta device, a plain one without an init hook."""

from torch import nn


def build_lazy_mlp() -> nn.Module:
    return nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.LazyLinear(1))


def build_parameterless() -> nn.Module:
    return nn.Sequential(nn.ReLU(), nn.Tanh())


class ValueDependentMLP(nn.Module):
    """Trains on any device, but its forward reads a tensor's value (as transformers' mask code does), which
    the meta device cannot give: the planner measures such a model's activations on meta and must not fail."""

    def __init__(self, in_features: int = 20):
        super().__init__()
        self.layer = nn.Linear(in_features, 1)

    def forward(self, inputs):
        return self.layer(inputs) if inputs.abs().sum().item() >= 0 else -self.layer(inputs)


def build_value_dependent_mlp(in_features: int = 20) -> nn.Module:
    return ValueDependentMLP(in_features)


def build_plain_mlp() -> nn.Module:
    """A plain nn.Module (no init_parameter hook, not a transformers model): 20 -> 64 -> 64 -> 64 -> 1, 9,729
    parameters in 8 tensors, the largest 64 x 64. A sharded layout builds it whole once, on rank 0."""
    return nn.Sequential(
        nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )
