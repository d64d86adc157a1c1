"""Models the planner must refuse: one whose size is unknown until its first forward, one with no parameters."""

from torch import nn


def build_lazy_mlp() -> nn.Module:
    return nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.LazyLinear(1))


def build_parameterless() -> nn.Module:
    return nn.Sequential(nn.ReLU(), nn.Tanh())
