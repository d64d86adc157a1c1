"""A resume never initialises: the model is allocated empty and the checkpoint's load fills it. A model whose
every way of initialising itself fails (its ``init_parameter``, a transformers ``_init_weights``, a plain
module's constructor drawing weights) resumes, and continues exactly where the run stopped."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from paratrain import Trainer
from paratrain.config.loading import load_config
from paratrain.models.gpt import GPT, GPTConfig
from paratrain.models.hf import causal_lm
from tests.harness import losses_by_step

GPT_ARGS = dict(vocab_size=128, block_size=16, n_layer=1, n_head=2, n_embd=16)
LLAMA = dict(
    model_type="llama", vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
)  # fmt: skip
initialising = {"allowed": True}  # what the models below consult: False while a resume must not initialise


class GuardedGPT(GPT):
    """paratrain's GPT whose init_parameter refuses to run while ``initialising["allowed"]`` is False (its
    constructor calls it on the meta tensors of a build on meta, which draws nothing)."""

    def init_parameter(self, name, tensor, generator):
        if not initialising["allowed"] and not tensor.is_meta:
            raise AssertionError(f"init_parameter({name}) ran during a resume")
        super().init_parameter(name, tensor, generator)


class GuardedPlain(nn.Module):
    """A plain module whose constructor draws its weights (its only initialisation), refusing during a resume
    (on meta it draws nothing: a parameterless build for its buffers is no initialisation)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(128, 16)
        self.head = nn.Linear(16, 128)
        if not initialising["allowed"] and not self.head.weight.is_meta:
            raise AssertionError("a plain module's constructor built real weights during a resume")

    def forward(self, tokens):
        return self.head(self.embed(tokens))


def guarded_llama():
    model = causal_lm(**LLAMA)
    original = model._init_weights

    def refusing(module):
        if not initialising["allowed"] and not all(p.is_meta for p in module.parameters(recurse=False)):
            raise AssertionError("transformers' _init_weights ran during a resume")
        original(module)

    model._init_weights = refusing
    return model


FACTORIES = {
    "init_parameter": lambda: GuardedGPT(GPTConfig(**GPT_ARGS)),
    "transformers": guarded_llama,
    "plain": GuardedPlain,
}


def config(output_dir: Path, max_steps: int):
    return load_config(
        None,
        [
            f"run.output_dir={output_dir}",
            f"train.max_steps={max_steps}",
            "train.global_batch_size=4",
            "train.micro_batch_size=2",
            "log.every_steps=1",
            "checkpoint.every_steps=2",
            "data.factory=paratrain.data.text:build_char_dataset",
            "data.args={block_size: 16, max_chars: 20000}",
        ],
    )


def train(output_dir: Path, max_steps: int, factory) -> Trainer:
    trainer = Trainer(config(output_dir, max_steps), model_factory=factory)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


@pytest.mark.parametrize("kind", FACTORIES)
def test_a_resume_initialises_nothing_and_continues_as_the_uninterrupted_run(tmp_path, kind, monkeypatch):
    factory = FACTORIES[kind]
    straight = train(tmp_path / "straight", 4, factory)
    # The run stopped at step 2: its checkpoint, in a run directory of its own.
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "step-2", tmp_path / "resumed" / "checkpoints" / "step-2")
    monkeypatch.setitem(initialising, "allowed", False)
    resumed = train(tmp_path / "resumed", 4, factory)
    assert resumed.progress.step == 4
    expected, actual = losses_by_step(tmp_path / "straight"), losses_by_step(tmp_path / "resumed")
    assert actual[3] == pytest.approx(expected[3], rel=1e-6) and actual[4] == pytest.approx(expected[4], rel=1e-6)
    weights = {name: p.detach() for name, p in straight.bare_model.named_parameters()}
    assert all(torch.allclose(p.detach(), weights[name]) for name, p in resumed.bare_model.named_parameters())


def test_the_guards_do_fire_when_a_run_starts_from_scratch(tmp_path, monkeypatch):
    """The test above proves something: the same guards stop a run that does initialise."""
    monkeypatch.setitem(initialising, "allowed", False)
    for factory in FACTORIES.values():
        with pytest.raises(Exception, match="during a resume"):
            train(tmp_path / "fresh", 2, factory)
