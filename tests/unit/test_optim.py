from __future__ import annotations

import math

import pytest
import torch

from paratrain.config.schema import OptimConfig
from paratrain.optim import build_lr_scheduler, build_optimizer, lr_multiplier, scaled_lr


def test_warmup_rises_linearly_then_cosine_decays_to_the_floor():
    options = OptimConfig(warmup_steps=4, min_lr_ratio=0.1)
    multipliers = [lr_multiplier(step, options, max_steps=14) for step in range(15)]
    assert multipliers[:4] == [0.25, 0.5, 0.75, 1.0]
    assert multipliers[4] == pytest.approx(1.0)
    assert multipliers[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert multipliers[14] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(multipliers[4:], multipliers[5:]))


def test_scheduler_sets_the_optimizer_lr_from_the_schedule():
    model = torch.nn.Linear(3, 3)
    options = OptimConfig(lr=0.2, warmup_steps=2, schedule="constant")
    optimizer = build_optimizer(model, options, dp_size=1)
    scheduler = build_lr_scheduler(optimizer, options, max_steps=10)
    seen = []
    for _ in range(3):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.1, 0.2, 0.2])


@pytest.mark.parametrize("mode,expected", [("none", 0.1), ("linear", 0.4), ("sqrt", 0.2)])
def test_lr_scaling_by_data_parallel_size(mode, expected):
    assert scaled_lr(OptimConfig(lr=0.1, lr_scaling=mode), dp_size=4) == pytest.approx(expected)


def test_weight_decay_applies_to_matrices_only():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.1), dp_size=1)
    decayed, plain = optimizer.param_groups
    assert [p.ndim for p in decayed["params"]] == [2] and decayed["weight_decay"] == 0.1
    assert all(p.ndim == 1 for p in plain["params"]) and plain["weight_decay"] == 0.0
