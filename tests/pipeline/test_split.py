"""Cutting a model's pipeline sequence into stages."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.models.gpt import build_gpt
from paratrain.parallel.pipeline.split import balance, measured_costs, parameter_costs, pipeline_sequence, split_at


def test_balance_minimises_the_most_expensive_stage():
    pieces = ("a", "b", "c", "d", "e")
    assert balance(pieces, [1, 1, 1, 1, 1], 2) == [("a", "b"), ("c", "d", "e")]
    assert balance(pieces, [4, 1, 1, 1, 1], 2) == [("a",), ("b", "c", "d", "e")]
    assert balance(pieces, [1, 1, 1, 1, 8], 3) == [("a", "b"), ("c", "d"), ("e",)]


def test_gpt_is_cut_between_its_declared_pieces_by_parameter_count():
    model = build_gpt(n_layer=4, n_embd=32, n_head=2)
    sequence = pipeline_sequence(model)
    assert sequence == ("embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "final_norm", "lm_head")
    stages = balance(sequence, parameter_costs(model, sequence), 2)
    assert stages == [("embed", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "final_norm", "lm_head")]


def test_split_points_end_stages_like_a_split_spec():
    model = build_gpt(n_layer=4, n_embd=32, n_head=2)
    stages = split_at(pipeline_sequence(model), ["blocks.0", "blocks.2"], model=model)
    assert stages == [("embed", "blocks.0"), ("blocks.1", "blocks.2"), ("blocks.3", "final_norm", "lm_head")]


def test_sequential_models_are_cut_between_children_and_tied_weights_are_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert pipeline_sequence(model) == ("0", "1", "2")
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    with pytest.raises(ConfigError, match="shares parameters between pieces"):
        pipeline_sequence(tied)


def test_measured_costs_time_every_piece():
    # The middle piece does over a hundred times the work of either neighbour: its cost must come out largest.
    # Nine repeats: the median shrugs off the few milliseconds a busy machine (the suite's other worker)
    # can steal from one timing; with two, one preempted run of the first piece outweighed the middle one.
    model = nn.Sequential(nn.Linear(8, 256), nn.Linear(256, 4096), nn.Linear(4096, 2))
    costs = measured_costs(list(model), torch.randn(64, 8), repeats=9)
    assert len(costs) == 3 and all(cost > 0 for cost in costs)
    assert costs[1] > max(costs[0], costs[2])
