"""Synthetic regression data, as in the classic DDP tutorials: random features, targets from a fixed linear map plus noise."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def build_regression_dataset(
    *, size: int = 2048, in_features: int = 20, out_features: int = 1, noise: float = 0.1, seed: int = 1234
) -> TensorDataset:
    """Factory for config files: ``data.factory: paratrain.data.regression:build_regression_dataset``.

    Its own seed keeps the data the same whatever ``train.seed`` is.
    """
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(size, in_features, generator=generator)
    true_map = torch.randn(in_features, out_features, generator=generator)
    targets = features @ true_map + noise * torch.randn(size, out_features, generator=generator)
    return TensorDataset(features, targets)
