"""A resume refuses config changes that alter what is trained, and lists the ones that do not."""

from __future__ import annotations

import logging

import pytest
import torch

from paratrain.checkpoint import Checkpointer
from paratrain.checkpoint.config_changes import check_resume_config, compare_configs
from paratrain.checkpoint.state import ModelState, Progress
from paratrain.checks.preflight import preflight
from paratrain.config.loading import load_config
from paratrain.errors import ConfigError
from paratrain.training.trainer import Trainer
from tests.harness import TINY_GPT, TINY_TEXT

BASE = [
    "train.max_steps=2",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "log.every_steps=1",
    "parallel.strategy=single",
    "train.device=cpu",
    f"model.args={TINY_GPT['args']}",
    f"data.args={TINY_TEXT['args']}",
]

MATH_CHANGES = {
    "global batch": ("train.global_batch_size=8", "train.global_batch_size: 4 -> 8"),
    "seed": ("train.seed=1", "train.seed: 0 -> 1"),
    "grad clip": ("train.grad_clip=null", "train.grad_clip: 1.0 -> None"),
    "model shape": ("model.args.n_layer=3", "model.args.n_layer: 2 -> 3"),
    "a new model argument": ("model.args.dropout=0.1", "model.args.dropout: <unset> -> 0.1"),
    "data": ("data.args.max_chars=1000", "data.args.max_chars: 40000 -> 1000"),
    "data order": ("data.shuffle=false", "data.shuffle: True -> False"),
    "loss": ("loss.factory=mypkg:loss", "loss.factory: 'paratrain.losses:cross_entropy' -> 'mypkg:loss'"),
    "learning rate": ("optim.lr=0.1", "optim.lr: 0.0003 -> 0.1"),
    "max_steps under the cosine schedule": ("train.max_steps=4", "train.max_steps: 2 -> 4"),
}
HARMLESS_CHANGES = {
    "layout": ("parallel.strategy=ddp", "parallel.strategy: 'single' -> 'ddp'"),
    "precision": ("precision=bf16", "precision: 'fp32' -> 'bf16'"),
    "micro-batch": ("train.micro_batch_size=1", "train.micro_batch_size: 2 -> 1"),
    "data loader workers": ("data.num_workers=2", "data.num_workers: 0 -> 2"),
    "logging": ("log.every_steps=5", "log.every_steps: 1 -> 5"),
    "checkpoint interval": ("checkpoint.every_steps=10", "checkpoint.every_steps: 0 -> 10"),
    "keep_last": ("checkpoint.keep_last=null", "checkpoint.keep_last: 3 -> None"),
    "output directory": ("run.output_dir=elsewhere", "run.output_dir: 'runs/paratrain' -> 'elsewhere'"),
}


def resolved(*overrides: str) -> dict:
    return load_config(None, [*BASE, *overrides]).model_dump(mode="json")


@pytest.mark.parametrize("override,line", MATH_CHANGES.values(), ids=MATH_CHANGES.keys())
def test_changes_to_what_is_trained_are_math(override, line):
    assert compare_configs(resolved(), resolved(override)).math == [line]


@pytest.mark.parametrize("override,line", HARMLESS_CHANGES.values(), ids=HARMLESS_CHANGES.keys())
def test_changes_to_how_it_is_computed_or_reported_are_harmless(override, line):
    changes = compare_configs(resolved(), resolved(override))
    assert (changes.math, changes.harmless) == ([], [line])


def test_max_steps_is_harmless_under_a_constant_schedule():
    changes = compare_configs(
        resolved("optim.schedule=constant"), resolved("optim.schedule=constant", "train.max_steps=9")
    )
    assert (changes.math, changes.harmless) == ([], ["train.max_steps: 2 -> 9"])


def test_a_key_the_saved_config_lacks_is_not_a_change():
    saved = resolved()
    del saved["optim"]["min_lr_ratio"]  # as if written before the key existed
    assert compare_configs(saved, resolved()) == compare_configs(resolved(), resolved())


def test_refusal_lists_every_changed_key_and_names_the_override(tmp_path):
    with pytest.raises(ConfigError) as refused:
        check_resume_config(
            resolved(),
            resolved("train.seed=1", "optim.lr=0.1", "log.every_steps=5"),
            checkpoint=tmp_path,
            allow_change=False,
        )
    message = str(refused.value)
    assert "train.seed: 0 -> 1" in message and "optim.lr: 0.0003 -> 0.1" in message
    assert "log.every_steps" not in message
    assert "checkpoint.allow_config_change=true" in message


def test_the_override_lets_math_changes_through(tmp_path):
    changes = check_resume_config(resolved(), resolved("train.seed=1"), checkpoint=tmp_path, allow_change=True)
    assert changes.math == ["train.seed: 0 -> 1"]


def save_checkpoint_of(config: dict, output_dir) -> None:
    """A complete checkpoint whose manifest records config (its tensors are not what is checked)."""
    checkpointer = Checkpointer(output_dir / "checkpoints", keep_last=None, rank=0, world_size=1, config=config)
    checkpointer.save(1, {"model": ModelState(torch.nn.Linear(2, 2)), "progress": Progress(1)})


@pytest.mark.parametrize("resume", ["auto", "path"])
def test_preflight_refuses_a_resume_that_changes_the_math_before_any_process_starts(tmp_path, resume):
    output = f"run.output_dir={tmp_path / 'run'}"
    save_checkpoint_of(resolved(output), tmp_path / "run")
    resume_override = "checkpoint.resume=" + ("auto" if resume == "auto" else str(tmp_path / "run/checkpoints/step-1"))

    def preflight_with(*overrides: str) -> None:
        preflight(load_config(None, [*BASE, output, resume_override, *overrides]), world_size=1, nproc_per_node=1)

    with pytest.raises(ConfigError, match=r"train.global_batch_size: 4 -> 8(.|\n)*checkpoint.allow_config_change"):
        preflight_with("train.global_batch_size=8")
    preflight_with("train.global_batch_size=8", "checkpoint.allow_config_change=true")
    preflight_with("log.every_steps=5")


def test_trainer_refuses_a_changed_config_and_logs_harmless_changes_on_resume(tmp_path, caplog):
    # The worker's own check, for runs started without the CLI's preflight (own torchrun, Python).
    mlp = [
        *BASE,
        f"run.output_dir={tmp_path / 'run'}",
        "model.factory=paratrain.models.mlp:build_mlp",
        "model.args={in_features: 4, hidden_features: 8, out_features: 1}",
        "loss.factory=paratrain.losses:mse",
        "data.factory=paratrain.data.regression:build_regression_dataset",
        "data.args={size: 64, in_features: 4}",
    ]
    first = Trainer(load_config(None, mlp))
    try:
        first.train()
    finally:
        first.close()

    with pytest.raises(ConfigError, match="train.seed: 0 -> 1"):
        Trainer(load_config(None, [*mlp, "train.seed=1"]))

    caplog.set_level(logging.INFO, logger="paratrain")
    # fp16 adds a gradient scaler the fp32 checkpoint does not hold: it starts fresh.
    resumed = Trainer(load_config(None, [*mlp, "log.every_steps=5", "train.micro_batch_size=1", "precision=fp16"]))
    try:
        resumed.train()  # the resume loads when training starts; at max_steps already, nothing trains
    finally:
        resumed.close()
    assert resumed.progress.step == 2
    assert (
        "config changes that keep the training math: log.every_steps: 1 -> 5; precision: 'fp32' -> 'fp16'; "
        "train.micro_batch_size: 2 -> 1"
    ) in caplog.text


def test_an_optional_section_set_on_one_side_only_is_one_change_to_the_math():
    from paratrain.checkpoint.config_changes import compare_configs

    lora = {"model": {"factory": "f", "lora": {"r": 4, "alpha": 8.0}}}
    full = {"model": {"factory": "f", "lora": None}}
    assert compare_configs(lora, full).math == ["model.lora: {'r': 4, 'alpha': 8.0} -> None"]
    assert compare_configs(full, lora).math == ["model.lora: None -> {'r': 4, 'alpha': 8.0}"]
    assert compare_configs(lora, {"model": {"factory": "f", "lora": {"r": 8, "alpha": 8.0}}}).math == [
        "model.lora.r: 4 -> 8"
    ]
