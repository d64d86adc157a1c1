"""Models a user might bring, with no parallel plan and no init_parameter."""

from torch import nn


def build_sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
