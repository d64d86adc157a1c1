"""Models a user might bring, with no parallel plan and no init_parameter."""

from torch import nn


def build_sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


class TwoLayers(nn.Module):
    """A user's own module: its forward is code, so nothing says where it may be cut."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.second(self.first(x).relu())


def build_two_layers() -> nn.Module:
    return TwoLayers()
