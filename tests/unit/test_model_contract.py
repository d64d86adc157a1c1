"""The model contract (paratrain/models/contract.py): hooks recognised on real models, misspelt ones warned."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import paratrain
from paratrain.callbacks.throughput import model_flops_per_sample
from paratrain.config.loading import load_config
from paratrain.models.contract import (
    HOOKS,
    CountsFlopsPerSample,
    CountsFlopsPerToken,
    DeclaresParallelPlan,
    InitialisesParameters,
    hook_name,
    misspelt_hooks,
    provided_hooks,
)
from paratrain.models.gpt import build_gpt
from paratrain.models.mlp import build_mlp
from paratrain.models.plan_derivation import plan_of
from tests.unit.hook_models import CountedSequential, build_misspelt_mlp


def test_each_hook_protocol_names_the_one_method_it_asks_for():
    assert [hook_name(hook) for hook in HOOKS] == [
        "parallel_plan",
        "init_parameter",
        "flops_per_sample",
        "flops_per_token",
        "use_sequence_functions",
        "use_expert_dispatch",
    ]


def test_paratrains_gpt_provides_the_plan_initialisation_flops_per_token_and_sequence_hooks():
    model = build_gpt(block_size=16, n_layer=2, n_head=2, n_embd=32)
    assert isinstance(model, DeclaresParallelPlan) and isinstance(model, InitialisesParameters)
    assert isinstance(model, CountsFlopsPerToken) and not isinstance(model, CountsFlopsPerSample)
    assert provided_hooks(model) == [
        "parallel_plan",
        "init_parameter",
        "flops_per_token",
        "use_sequence_functions",
        "use_expert_dispatch",
    ]
    assert plan_of(model).blocks == ("blocks.0", "blocks.1")
    assert misspelt_hooks(model) == []


def test_a_plain_sequential_provides_no_hook_and_its_children_are_its_pipeline():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    assert provided_hooks(model) == [] and misspelt_hooks(model) == []
    assert plan_of(model).pipeline_sequence == ("0", "1", "2")


def test_a_transformers_model_provides_no_hook_and_none_of_its_methods_reads_as_a_misspelling():
    pytest.importorskip("transformers")
    from paratrain.models.hf import causal_lm
    from tests.unit.test_hf_models import LLAMA

    model = causal_lm(**LLAMA)
    assert provided_hooks(model) == []
    assert misspelt_hooks(model) == []  # hundreds of PreTrainedModel methods, none one edit from a hook
    assert plan_of(model).blocks == ("model.layers.0",)  # derived from _no_split_modules instead


def test_the_throughput_monitor_counts_flops_from_whichever_hook_the_model_provides():
    gpt = build_gpt(block_size=16, n_layer=2, n_head=2, n_embd=32)
    assert model_flops_per_sample(gpt, tokens_per_sample=16) == gpt.flops_per_token(16) * 16
    counted = CountedSequential(nn.Linear(4, 1))
    assert model_flops_per_sample(counted, tokens_per_sample=None) == 1234.0
    plain = nn.Sequential(nn.Linear(4, 1))  # 5 parameters, no hook: 6 x N per token, one token
    assert model_flops_per_sample(plain, tokens_per_sample=None) == 30.0


def test_a_method_one_letter_from_a_hook_is_named_with_the_hook_it_resembles():
    messages = misspelt_hooks(build_misspelt_mlp())
    assert len(messages) == 2  # flops_per_tok is two letters from flops_per_token: not a typo
    assert "MisspeltMLP defines init_parameters(), one letter away from the hook init_parameter()" in messages[0]
    assert "MisspeltMLP defines paralel_plan(), one letter away from the hook parallel_plan()" in messages[1]
    assert provided_hooks(build_misspelt_mlp()) == []
    assert provided_hooks(build_mlp()) == ["parallel_plan", "init_parameter"]


def test_the_trainer_warns_once_at_build_about_a_misspelt_hook(tmp_path, caplog):
    config = load_config(
        None,
        [
            f"run.output_dir={tmp_path / 'run'}",
            "model.factory=tests.unit.hook_models:build_misspelt_mlp",
            "loss.factory=paratrain.losses:mse",
            "data.factory=paratrain.data.regression:build_regression_dataset",
            "data.args={in_features: 4}",
            "train.max_steps=1",
        ],
    )
    with caplog.at_level(logging.WARNING, logger="paratrain"):
        paratrain.Trainer(config)
    warned = [
        record.getMessage() for record in caplog.records if "one letter away from the hook" in record.getMessage()
    ]
    assert len(warned) == 2
    assert any("paralel_plan()" in message and "parallel_plan()" in message for message in warned)
    assert torch.distributed.is_initialized() is False
