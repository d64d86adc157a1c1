"""The non-finite guard's pieces in-process: the skip/stop verdicts, the weight check, strict metrics
lines, checkpoints recorded as not finite passed over by resume: auto, and config values that could
only train garbage refused by the CLI."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from paratrain.checkpoint import Checkpointer
from paratrain.checkpoint.state import ModelState, Progress
from paratrain.nonfinite import NonFiniteGuard, PendingVerdicts, step_unless_nonfinite, weights_are_finite
from paratrain.tracking.metrics import MetricsLogger, strict_json_record
from paratrain.tracking.trackers import RunInfo


def test_skip_drops_isolated_steps_and_stops_after_max_skips_in_a_row():
    guard = NonFiniteGuard("skip", max_skips=2)
    verdicts = [guard.should_stop(step, finite=finite) for step, finite in enumerate([1, 0, 1, 0, 0], start=1)]
    assert verdicts == [False, False, False, False, True]
    assert guard.skipped_steps == [2, 4, 5]


def test_stop_stops_at_the_first_non_finite_step():
    guard = NonFiniteGuard("stop", max_skips=5)
    assert not guard.should_stop(1, finite=True)
    assert guard.should_stop(2, finite=False)


def test_verdicts_read_one_step_late_name_the_step_that_was_not_finite():
    verdicts = PendingVerdicts(NonFiniteGuard("stop", max_skips=5))
    for step, finite in ((1, True), (2, False)):
        verdicts.add(step, torch.tensor(finite))
        assert verdicts.settle(keep_newest=True) is None  # step 2's verdict waits while step 3 is queued
    verdicts.add(3, torch.tensor(True))
    assert verdicts.settle(keep_newest=True) == 2
    assert verdicts.settle() is None and verdicts.pending == []


@pytest.mark.parametrize("name", ["adamw", "sgd"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused: skipped on the device", "foreach: read on the host"])
def test_a_step_with_a_non_finite_norm_leaves_weights_and_optimizer_state_as_they_were(name, fused):
    model = torch.nn.Linear(3, 2)
    kernel = {"fused": True} if fused else {"foreach": True}
    optimizer = (
        torch.optim.AdamW(model.parameters(), lr=0.1, **kernel)
        if name == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, **kernel)
    )

    def step(norm: float) -> bool:
        model(torch.ones(4, 3)).sum().backward()
        return bool(step_unless_nonfinite(optimizer, torch.tensor(norm)))

    assert step(1.0)  # optimizer state exists from here on
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_before = [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in optimizer.state.values()]
    assert not step(float("nan")) and not step(float("inf"))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    for saved, now in zip(state_before, optimizer.state.values(), strict=True):
        for key, value in saved.items():
            assert torch.equal(torch.as_tensor(now[key]), torch.as_tensor(value)), key
    assert not hasattr(optimizer, "found_inf")  # a later GradScaler or plain step sees no stale verdict
    assert step(1.0) and not torch.equal(model.weight, before["weight"])


def test_weights_are_finite_finds_one_nan_anywhere():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    assert weights_are_finite(model)
    with torch.no_grad():
        model[1].bias[0] = float("nan")
    assert not weights_are_finite(model)


def test_metrics_lines_are_strict_json_with_non_finite_values_named(tmp_path):
    record = {"step": 3, "loss": float("nan"), "lr": 1e-3, "grad_norm": float("inf"), "samples_per_s": 1.0}
    assert strict_json_record(record)["nonfinite"] == ["loss", "grad_norm"]
    run = RunInfo("test", tmp_path, {})
    metrics = MetricsLogger(run, trackers=["jsonl", "tensorboard"], progress_bar="off", start_step=0, max_steps=3)
    metrics.log(record)
    metrics.close()
    line = (tmp_path / "metrics.jsonl").read_text().splitlines()[0]
    parsed = json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in {line}"))
    assert parsed["loss"] is None and parsed["grad_norm"] is None and parsed["lr"] == 1e-3


def test_resume_auto_passes_over_a_checkpoint_recorded_as_not_finite(tmp_path, caplog):
    checkpointer = Checkpointer(tmp_path / "checkpoints", keep_last=None, rank=0, world_size=1, config={})
    for step, finite in ((10, True), (20, False)):
        state = {"model": ModelState(torch.nn.Linear(2, 2)), "progress": Progress(step)}
        checkpointer.save(step, state, weights_finite=finite)
    with caplog.at_level(logging.WARNING, logger="paratrain"):
        assert checkpointer.latest_verified() == checkpointer.directory / "step-10"
    assert "step-20: its weights are not finite" in caplog.text
