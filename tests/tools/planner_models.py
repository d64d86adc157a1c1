"""Models the planner must refuse: one whose size is unknown until its first forward, one with no parameters;
and one it must plan although its forward cannot run on the meta device."""

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
