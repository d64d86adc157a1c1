"""The CLI end to end: outputs a run leaves, config show, export, user factories, plain torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from paratrain.launch.run_lock import LOCK_NAME
from tests.harness import (
    REPO_ROOT,
    checkpoint_weights,
    in_private_network,
    private_network_unavailable,
    read_metrics,
    run_cli,
    tiny_config,
    train,
    write_config,
)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    """A 2-process ddp run with TensorBoard on and checkpoints every 3 steps, kept 2 at a time."""
    tmp_path = tmp_path_factory.mktemp("ddp")
    config = tiny_config(
        tmp_path / "run",
        parallel={"strategy": "ddp"},
        train={"max_steps": 12},
        log={"every_steps": 4, "tensorboard": True},
        checkpoint={"every_steps": 3, "keep_last": 2},
    )
    train(write_config(tmp_path / "config.yaml", config), nproc=2)
    return tmp_path / "run"


def test_metrics_jsonl_has_one_record_per_logged_step_with_the_documented_fields(ddp_run):
    records = read_metrics(ddp_run)
    assert [r["step"] for r in records] == [1, 4, 8, 12]
    fields = {"step", "loss", "lr", "grad_norm", "step_time_s", "samples_per_s", "tokens_per_s", "world_size"}
    assert all(fields <= r.keys() for r in records)
    assert all(r["world_size"] == 2 for r in records)
    assert records[-1]["tokens_per_s"] == pytest.approx(records[-1]["samples_per_s"] * 16)


def test_resolved_config_is_written_and_reloads(ddp_run):
    resolved = yaml.safe_load((ddp_run / "config.yaml").read_text())
    assert resolved["parallel"]["strategy"] == "ddp"
    assert resolved["optim"]["name"] == "adamw"  # defaults are spelled out


def test_tensorboard_event_files_hold_the_loss(ddp_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(ddp_run / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == [1, 4, 8, 12]


def test_rotation_keeps_the_last_two_checkpoints(ddp_run):
    assert sorted(p.name for p in (ddp_run / "checkpoints").iterdir()) == ["step-12", "step-9"]


def test_export_writes_the_checkpoint_weights_as_safetensors(ddp_run, tmp_path):
    out = tmp_path / "model.safetensors"
    result = run_cli(["export", str(ddp_run / "checkpoints/step-12"), "--out", str(out)])
    assert result.returncode == 0, result.stderr
    exported = load_file(str(out))
    expected = checkpoint_weights(ddp_run / "checkpoints/step-12")
    assert exported.keys() == expected.keys() and "blocks.0.attn.q_proj.weight" in exported
    assert all(torch.equal(exported[k], expected[k]) for k in expected)


def test_export_refuses_an_incomplete_checkpoint(ddp_run, tmp_path):
    result = run_cli(["export", str(tmp_path), "--out", str(tmp_path / "m.safetensors")])
    assert result.returncode == 2 and "paratrain-manifest.json is missing" in result.stderr


def test_config_show_prints_the_resolved_config_with_overrides(tmp_path):
    path = write_config(tmp_path / "c.yaml", {"train": {"max_steps": 5}})
    result = run_cli(["config", "show", str(path), "train.seed=9"])
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["train"]["max_steps"] == 5 and shown["train"]["seed"] == 9
    assert shown["checkpoint"]["resume"] == "auto"


def test_user_model_data_and_loss_factories_import_from_the_working_directory(tmp_path):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "workload.py").write_text(
        textwrap.dedent("""
        import torch
        from torch.utils.data import TensorDataset

        def build_model(width=8):
            return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))

        def build_data(size=64):
            x = torch.randn(size, 4, generator=torch.Generator().manual_seed(0))
            return TensorDataset(x, x.sum(dim=1, keepdim=True))

        def build_loss():
            return torch.nn.functional.l1_loss
    """)
    )
    config = tiny_config(
        tmp_path / "run",
        model={"factory": "mypkg.workload:build_model", "args": {"width": 16}},
        data={"factory": "mypkg.workload:build_data", "args": {}},
        loss={"factory": "mypkg.workload:build_loss"},
        train={"max_steps": 40},
        optim={"lr": 0.02},
        log={"every_steps": 10},
    )
    result = run_cli(["train", str(write_config(tmp_path / "c.yaml", config))], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    records = read_metrics(tmp_path / "run")
    assert "tokens_per_s" not in records[-1]  # float features are not tokens
    assert records[-1]["loss"] < records[0]["loss"]


def test_worker_runs_under_plain_torchrun_and_its_restart_keeps_the_run_lock(tmp_path):
    if reason := private_network_unavailable():
        pytest.skip(reason)
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run", parallel={"strategy": "ddp"}))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "-m",
        "paratrain.train",
        str(config),
        "train.max_steps=5",
    ]
    # SIGKILL of rank 0, the lock's holder for the torchrun agent: the restarted rank 0 enters it again.
    env = {**os.environ, "PARATRAIN_FAULT": "after_step:2:0"}
    result = subprocess.run(
        in_private_network(command), capture_output=True, text=True, timeout=180, cwd=REPO_ROOT, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_metrics(tmp_path / "run")[-1]["step"] == 5
    assert "already held by this run" in result.stderr and "took over" not in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "run" / LOCK_NAME).exists(), "released when rank 0 finished"


@pytest.mark.parametrize("strategy,precision", [("dp", "fp32"), ("single", "bf16"), ("single", "fp16")])
def test_data_parallel_and_mixed_precision_train_on_cpu(tmp_path, strategy, precision):
    config = write_config(
        tmp_path / "c.yaml", tiny_config(tmp_path / "run", parallel={"strategy": strategy}, train={"max_steps": 10})
    )
    result = train(config, f"precision={precision}")
    if strategy == "dp":
        assert "running on cpu without DataParallel" in result.stderr
    records = read_metrics(tmp_path / "run")
    assert records[-1]["step"] == 10 and records[-1]["loss"] < records[0]["loss"]
