"""Every layout resumes itself bit for bit, and its checkpoint resumes under other layouts.

Each layout trains 6 steps (checkpoints at 3 and 6). Resuming its step-3 checkpoint under the same
layout, in a fresh process state, must end with final weights ``torch.equal`` to the uninterrupted
run's; resuming it under single and two other layouts must continue with the same losses (within
1e-5). A resume is a new Trainer reading a checkpoint, in the launch that wrote it: what a killed
run's restart does after its processes start (real SIGKILL + ``--max-restarts`` restarts are in
test_pipeline_resume_after_kill below and tests/integration/test_resume.py).

Launches: one-process layouts train in the test process; the 4- and 2-process layouts each in one
launch (tests/train_many.py), in the order 1, 4, 2, 1 processes so every resume comes after its source.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paratrain.config.loading import load_config
from tests.harness import (
    checkpoint_weights,
    losses_by_step,
    max_relative_difference,
    tiny_config,
    train,
    train_in_this_process,
    train_many_in_one_launch,
    write_config,
)

STEPS, MIDPOINT = 6, 3
LOSS_RTOL = 1e-5

# The module's runs are trained together by its fixture, within the first test's time limit.
pytestmark = pytest.mark.timeout(900)

PP = "parallel.strategy=pp"
LAYOUTS: dict[str, tuple[list[str], int]] = {
    "single": ([], 1),
    "model_parallel": (["parallel.strategy=model_parallel", "pipeline.devices=[cpu,cpu,cpu]"], 1),
    "ddp 2": (["parallel.strategy=ddp"], 2),
    "fsdp 2": (["parallel.strategy=fsdp"], 2),
    "tp 2": (["parallel.strategy=tp"], 2),
    "pp 2 GPipe": ([PP, "pipeline.schedule=GPipe"], 2),
    "pp 2 1F1B": ([PP, "pipeline.schedule=1F1B"], 2),
    "pp 2 1F1B async": ([PP, "pipeline.schedule=1F1B", "checkpoint.async_save=true"], 2),
    "interleaved 2x2": ([PP, "pipeline.schedule=Interleaved1F1B"], 2),
    "ZBV 2x2": ([PP, "pipeline.schedule=ZBVZeroBubble"], 2),
    "hsdp 2x2": (["parallel.strategy=hsdp", "parallel.dp_replicate=2"], 4),
    "fsdp+tp 2x2": (["parallel.strategy=fsdp", "parallel.tp=2"], 4),
    "ddp x pp": (["parallel.strategy=ddp", "parallel.pp=2"], 4),
    "fsdp x pp": (["parallel.strategy=fsdp", "parallel.pp=2"], 4),
    "tp x pp": (["parallel.strategy=tp", "parallel.pp=2"], 4),
}

# Source -> the layouts its step-3 checkpoint resumes under, besides single (trained in the test
# process, last). Targets have no more processes than their source (4-process sources move to
# 2-process layouts: a 4-process launch is the costliest), except from one-process sources, trained first.
MOVES: dict[str, tuple[str, ...]] = {
    "single": ("model_parallel", "interleaved 2x2", "fsdp 2"),
    "model_parallel": ("tp 2", "pp 2 GPipe"),
    "ddp 2": ("fsdp 2", "pp 2 1F1B"),
    "fsdp 2": ("tp 2", "ZBV 2x2"),
    "tp 2": ("ddp 2", "pp 2 GPipe"),
    "pp 2 GPipe": ("ZBV 2x2", "ddp 2"),
    "pp 2 1F1B": ("interleaved 2x2", "fsdp 2"),
    "interleaved 2x2": ("pp 2 1F1B", "tp 2"),
    "ZBV 2x2": ("interleaved 2x2", "fsdp 2"),
    "hsdp 2x2": ("fsdp 2", "pp 2 1F1B"),
    "fsdp+tp 2x2": ("pp 2 1F1B", "tp 2"),
    "ddp x pp": ("interleaved 2x2", "ddp 2"),
    "fsdp x pp": ("pp 2 GPipe", "fsdp 2"),
    "tp x pp": ("ZBV 2x2", "tp 2"),
}
CROSS = [
    (source, target)
    for source, targets in MOVES.items()
    for target in (targets if source == "single" else ("single", *targets))
]


def _dir_name(name: str) -> str:
    return name.replace(" ", "_").replace("+", "_")


class Matrix:
    """Every run of the module, trained by ``train_all``; ``dir(name)`` is where one wrote its output."""

    def __init__(self, root: Path):
        self.root = root
        self.runs: list[tuple[str, list[str], int, int]] = []  # (name, overrides, processes, source's)
        for layout, (overrides, nproc) in LAYOUTS.items():
            self.runs.append((layout, overrides, nproc, nproc))
            self.runs.append((f"{layout} resumed", [*overrides, self._resume(layout)], nproc, nproc))
        for source, target in CROSS:
            overrides, nproc = LAYOUTS[target]
            self.runs.append((f"{source} to {target}", [*overrides, self._resume(source)], nproc, LAYOUTS[source][1]))

    def dir(self, name: str) -> Path:
        return self.root / _dir_name(name)

    def train_all(self) -> None:
        """One-process runs from one-process sources, then 4 and 2 processes, then the rest of one."""
        self._in_this_process([run for run in self.runs if run[2] == 1 and run[3] == 1])
        for nproc in (4, 2):
            self._in_one_launch([run for run in self.runs if run[2] == nproc], nproc)
        self._in_this_process([run for run in self.runs if run[2] == 1 and run[3] > 1])

    def _resume(self, source: str) -> str:
        return f"checkpoint.resume={self.dir(source)}/checkpoints/step-{MIDPOINT}"

    def _config(self, name: str) -> Path:
        config = tiny_config(
            self.root / _dir_name(name),
            train={"max_steps": STEPS},
            checkpoint={"every_steps": MIDPOINT, "keep_last": None},
        )
        return write_config(self.root / f"{_dir_name(name)}.yaml", config)

    def _in_this_process(self, runs) -> None:
        for name, overrides, *_ in runs:
            train_in_this_process(load_config(self._config(name), overrides))

    def _in_one_launch(self, runs, nproc: int) -> None:
        launch = [(self._config(name), overrides) for name, overrides, *_ in runs]
        train_many_in_one_launch(launch, nproc, self.root / f"launch-{nproc}.json")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> Matrix:
    matrix = Matrix(tmp_path_factory.mktemp("resume-matrix"))
    matrix.train_all()
    return matrix


def _final_weights(run_dir: Path, prefix: str = "model.") -> dict[str, torch.Tensor]:
    return checkpoint_weights(run_dir / f"checkpoints/step-{STEPS}", prefix)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_resumed_from_its_own_checkpoint_ends_bit_identical(matrix, layout):
    uninterrupted, resumed = matrix.dir(layout), matrix.dir(f"{layout} resumed")
    assert min(losses_by_step(resumed)) == MIDPOINT + 1  # continued, did not start over
    expected_losses = {step: loss for step, loss in losses_by_step(uninterrupted).items() if step > MIDPOINT}
    assert losses_by_step(resumed) == expected_losses
    for prefix in ("model.", "optimizer.state."):
        expected, actual = _final_weights(uninterrupted, prefix), _final_weights(resumed, prefix)
        assert actual.keys() == expected.keys()
        unequal = [name for name in expected if not torch.equal(actual[name], expected[name])]
        assert not unequal, f"{layout}: {len(unequal)} tensors differ after resuming, e.g. {unequal[:3]}"


@pytest.mark.parametrize("source,target", CROSS)
def test_checkpoint_resumed_under_another_layout_continues_the_same_losses(matrix, source, target):
    moved = losses_by_step(matrix.dir(f"{source} to {target}"))
    assert min(moved) == MIDPOINT + 1
    expected = {step: loss for step, loss in losses_by_step(matrix.dir(source)).items() if step > MIDPOINT}
    assert max_relative_difference(moved, expected) <= LOSS_RTOL


def test_pipeline_killed_after_a_checkpoint_restarts_by_itself_and_ends_bit_identical(matrix, tmp_path):
    """A real SIGKILL of one fsdp x pp worker after step 4 under --max-restarts 1: the launcher restarts
    the group, which resumes from step 3 and ends where the uninterrupted run ends."""
    overrides, nproc = LAYOUTS["fsdp x pp"]
    config = write_config(
        tmp_path / "killed.yaml",
        tiny_config(tmp_path / "killed", train={"max_steps": STEPS}, checkpoint={"every_steps": MIDPOINT}),
    )
    result = train(
        config, *overrides, "--max-restarts", "1", nproc=nproc, env={"PARATRAIN_FAULT": f"after_step:{MIDPOINT + 1}:3"}
    )
    assert f"resumed from {tmp_path / 'killed'}/checkpoints/step-{MIDPOINT}" in result.stderr
    expected, actual = _final_weights(matrix.dir("fsdp x pp")), _final_weights(tmp_path / "killed")
    assert actual.keys() == expected.keys()
    assert all(torch.equal(actual[name], expected[name]) for name in expected)
