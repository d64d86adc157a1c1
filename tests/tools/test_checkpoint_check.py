"""``paratrain checkpoint check``: a checkpoint loaded under another layout without training, what moved
said, and a checkpoint that cannot load named before any machine is rented for it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from paratrain.config.loading import load_config
from paratrain.errors import EXIT_USER_ERROR
from paratrain.tools.checkpoint_check import check_config, compare_with_saved
from paratrain.train import run as train_in_this_process
from paratrain.training.trainer import Trainer
from tests.harness import run_cli, run_cli_in_process, tiny_config, write_config

WIDER = "model.args={block_size: 16, n_layer: 2, n_head: 2, n_embd: 64}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A single-process run's step-2 checkpoint (tiny GPT, width 32)."""
    root = tmp_path_factory.mktemp("check")
    config = write_config(
        root / "run.yaml", tiny_config(root / "run", train={"max_steps": 2}, checkpoint={"every_steps": 2})
    )
    train_in_this_process(load_config(config, []))
    return root / "run" / "checkpoints" / "step-2"


def test_a_single_process_checkpoint_loads_under_fsdp_in_this_process_and_says_what_moved(checkpoint, capsys):
    before = sorted(p.name for p in checkpoint.parent.parent.iterdir())
    code, stderr = run_cli_in_process(["checkpoint", "check", str(checkpoint), "parallel.strategy=fsdp"])
    assert code == 0, stderr
    report = capsys.readouterr().out
    assert "step 2, saved by 1 process(es) as single" in report
    assert "loads as fsdp" in report and "embed.tok.weight [128, 32]: saved in 1 piece(s) -> S(0)" in report
    assert re.search(r"loaded values: \d+ tensor pieces over all ranks equal the saved ones\n", report)
    assert sorted(p.name for p in checkpoint.parent.parent.iterdir()) == before  # nothing written beside the run


def test_a_checkpoint_that_cannot_load_is_refused_naming_the_tensor(checkpoint):
    code, stderr = run_cli_in_process(
        ["checkpoint", "check", str(checkpoint), WIDER, "checkpoint.allow_config_change=true"]
    )
    assert code == EXIT_USER_ERROR
    assert "does not load under single" in stderr and "model.embed.tok.weight" in stderr
    assert "Traceback" not in stderr


def test_a_changed_model_is_refused_as_a_resume_would_be(checkpoint):
    code, stderr = run_cli_in_process(["checkpoint", "check", str(checkpoint), WIDER])
    assert code == EXIT_USER_ERROR and "model.args.n_embd: 32 -> 64" in stderr


def test_two_processes_load_it_under_tensor_parallel(checkpoint):
    checked = run_cli(["checkpoint", "check", str(checkpoint), "parallel.strategy=tp", "--nproc-per-node", "2"])
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert "loads as tp: tp=2 on 2 process(es)" in checked.stdout
    assert "attn.q_proj.weight [32, 32]: saved in 1 piece(s) -> S(0) over 2 ranks, [16, 32] here" in checked.stdout
    assert re.search(r"loaded values: \d+ tensor pieces over all ranks equal the saved ones", checked.stdout)


def test_a_load_whose_values_differ_from_the_saved_ones_is_caught(checkpoint, tmp_path):
    """What the comparison finds when a load goes wrong silently: one weight and one AdamW moment changed
    after loading."""
    trainer = Trainer(check_config(checkpoint, [], tmp_path))
    try:
        trainer.checkpoints.load(checkpoint)
        assert compare_with_saved(checkpoint, trainer).differing == []
        weight = trainer.bare_model.get_parameter("embed.tok.weight")
        with torch.no_grad():
            weight[3, 1] += 1e-6
        trainer.optimizer.state[weight]["exp_avg"][0, 0] += 1e-6
        comparison = compare_with_saved(checkpoint, trainer)
    finally:
        trainer.close()
    assert comparison.differing == ["model.embed.tok.weight", "optimizer.state.embed.tok.weight.exp_avg"]
    assert comparison.compared > 2 * len(list(trainer.bare_model.parameters()))  # weights, moments and steps
