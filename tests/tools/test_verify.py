"""paratrain verify: passes a correct layout, fails a broken one, refuses one the machine cannot run."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from paratrain.cli import main
from paratrain.tools.verify import LOSS_RTOL, StepLoss, Verdict, compare, format_verdict
from tests.harness import REPO_ROOT, TINY_GPT, read_metrics, tiny_config, write_config

STEPS = 3
BROKEN_GPT = {"factory": "tests.tools.broken_models:build_gpt_with_wrong_gradient", "args": TINY_GPT["args"]}


def verify_config(tmp_path: Path, **sections) -> Path:
    # SGD without clipping: AdamW would normalise a gradient scaled by a constant away.
    defaults = {"parallel": {"strategy": "ddp"}, "optim": {"name": "sgd", "lr": 0.5}, "train": {"grad_clip": None}}
    config = tiny_config(
        tmp_path / "run",
        **{name: {**defaults.get(name, {}), **sections.get(name, {})} for name in defaults.keys() | sections.keys()},
    )
    return write_config(tmp_path / "config.yaml", config)


def verdict_lines(stdout: str) -> list[tuple[int, float, float, float]]:
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)", stdout, flags=re.MULTILINE)
    return [(int(step), float(a), float(b), float(d)) for step, a, b, d in rows]


def run_verify(config: Path, capsys, monkeypatch) -> tuple[int, str]:
    """verify in this process (it starts both paratrain train runs as subprocesses): saves an interpreter start."""
    monkeypatch.chdir(REPO_ROOT)  # where the runs import tests.tools.broken_models from
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as the harness runs every CLI command
    code = main(["verify", str(config), "--nproc-per-node", "2", "--steps", str(STEPS)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_verify_passes_ddp_on_two_processes_against_one(tmp_path, capsys, monkeypatch):
    code, output = run_verify(verify_config(tmp_path), capsys, monkeypatch)

    assert code == 0, output[-3000:]
    assert "PASS: ddp on 2 processes matches one process" in output
    rows = verdict_lines(output)
    assert [row[0] for row in rows] == list(range(1, STEPS + 1))
    assert all(diff <= LOSS_RTOL for *_, diff in rows)
    layout, reference = read_metrics(tmp_path / "run/verify/layout"), read_metrics(tmp_path / "run/verify/reference")
    assert {r["world_size"] for r in layout} == {2} and {r["world_size"] for r in reference} == {1}
    assert reference[-1]["loss"] < reference[0]["loss"], "the reference should learn, or parity proves little"
    assert not (tmp_path / "run/verify/layout/checkpoints").exists()


def test_verify_fails_a_layout_that_scales_a_gradient_wrongly_and_exits_1(tmp_path, capsys, monkeypatch):
    code, output = run_verify(verify_config(tmp_path, model=BROKEN_GPT), capsys, monkeypatch)

    assert code == 1, output[-3000:]
    assert "FAIL: ddp on 2 processes does not match one process" in output
    rows = verdict_lines(output)
    assert rows[0][3] <= LOSS_RTOL  # step 1's loss comes before any update: the bug shows from step 2
    assert max(diff for *_, diff in rows) > 10 * LOSS_RTOL


def test_verify_refuses_more_processes_than_the_machine_can_run(tmp_path, capsys):
    too_many = 4 * (os.cpu_count() or 1) + 1
    assert (
        main(["verify", str(verify_config(tmp_path, train={"device": "cpu"})), "--nproc-per-node", str(too_many)]) == 2
    )
    error = capsys.readouterr().err
    assert f"--nproc-per-node {too_many} on CPU" in error and "verify at a smaller world size" in error
    assert "model.args.n_layer=2" in error
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_verify_refuses_cuda_on_a_machine_without_gpus(tmp_path, capsys):
    assert main(["verify", str(verify_config(tmp_path, train={"device": "cuda"})), "--nproc-per-node", "2"]) == 2
    assert "train.device=cuda but this machine has no GPU" in capsys.readouterr().err


def test_verify_reports_a_layout_preflight_refuses_naming_the_layout(tmp_path, capsys):
    config = verify_config(
        tmp_path, parallel={"strategy": "ddp"}, train={"global_batch_size": 6, "micro_batch_size": 2}
    )
    assert main(["verify", str(config), "--nproc-per-node", "4"]) == 2
    error = capsys.readouterr().err
    assert "the layout (ddp on 4 processes) cannot run here" in error and "train.global_batch_size=6" in error


def test_verdict_fails_when_a_step_is_missing_or_over_tolerance():
    assert compare("x", {1: 2.0, 2: 1.0}, {1: 2.0, 2: 1.0}, tolerance=LOSS_RTOL).passed
    assert not compare("x", {1: 2.0}, {1: 2.0, 2: 1.0}, tolerance=LOSS_RTOL).passed
    over = Verdict("x", [StepLoss(1, 2.0, 2.0), StepLoss(2, 1.0 + 2e-5, 1.0)], LOSS_RTOL, [])
    assert not over.passed and "first at step 2" in format_verdict(over)
