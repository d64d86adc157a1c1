"""checkpoint.every_steps: auto, as data: the Young/Daly interval from measured save costs, re-planned when they
drift, the failure rate learned from the run directory's attempts, and, on a simulated failure history, a
loss of time within 10 % of what the Young/Daly optimum loses on the same failures."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from paratrain.checkpoint.interval import AutoInterval, expected_loss_rate, plan_interval, young_daly_seconds
from paratrain.checkpoint.policy import save_due
from paratrain.checkpoint.run_history import ATTEMPTS_NAME, FailureHistory, read_history, record_end, record_start
from paratrain.config.loading import load_config
from paratrain.config.schema import CheckpointConfig
from paratrain.errors import ConfigError


def test_the_interval_is_young_dalys_in_whole_steps():
    plan = plan_interval(save_cost_s=10.0, step_time_s=2.0, mtbf_s=8 * 3600.0, restart_s=30.0)
    assert young_daly_seconds(save_cost_s=10.0, mtbf_s=8 * 3600.0) == pytest.approx(758.9, abs=0.1)
    assert plan.steps == 379 and plan.seconds == 758.0 and plan.step_time_s == 2.0
    assert plan.lost_per_failure_s == pytest.approx(379 + 30)
    assert plan.overhead == pytest.approx(10 / 758)
    assert "every 379 steps" in plan.describe() and "checkpoint overhead 1.32 %" in plan.describe()


def test_the_young_daly_interval_minimises_the_expected_loss():
    cost, mtbf = 7.0, 5000.0
    best = young_daly_seconds(save_cost_s=cost, mtbf_s=mtbf)
    rate = expected_loss_rate(interval_s=best, save_cost_s=cost, mtbf_s=mtbf)
    for factor in (0.5, 0.8, 1.25, 2.0):
        assert expected_loss_rate(interval_s=best * factor, save_cost_s=cost, mtbf_s=mtbf) > rate


def test_auto_saves_after_the_first_step_then_every_planned_interval():
    auto = AutoInterval(mtbf_s=3600.0)
    assert auto.due(1)
    plan = auto.saved(1, save_cost_s=2.0, step_time_s=1.0)
    assert plan is not None and plan.steps == 120  # sqrt(2 x 2 x 3600)
    assert not auto.due(120) and auto.due(121)


def test_auto_plans_again_only_when_the_save_cost_drifts():
    auto = AutoInterval(mtbf_s=3600.0)
    auto.saved(1, save_cost_s=2.0, step_time_s=1.0)
    assert auto.saved(121, save_cost_s=2.2, step_time_s=1.05) is None  # noise: the plan stands
    for step in (241, 361):
        auto.saved(step, save_cost_s=8.0, step_time_s=1.0)  # the disk got slower
    replanned = auto.saved(481, save_cost_s=8.0, step_time_s=1.0)  # the median of the recent costs moved
    assert replanned is not None and replanned.steps == 240  # sqrt(2 x 8 x 3600)
    assert auto.plan == replanned


def test_save_due_under_auto_marks_only_interval_saves_periodic():
    options = CheckpointConfig(every_steps="auto", mtbf_hours=1.0, async_save=True)
    auto = AutoInterval(mtbf_s=3600.0)
    assert save_due(1, options, max_steps=100, auto=auto).periodic  # the measuring save
    auto.saved(1, save_cost_s=0.5, step_time_s=1.0)  # every 60 steps
    assert save_due(30, options, max_steps=100, auto=auto) is None
    due = save_due(61, options, max_steps=100, auto=auto)
    assert due.periodic and not due.blocking
    last = save_due(100, options, max_steps=100, auto=auto)
    assert last.blocking and not last.periodic


def test_failures_are_attempts_that_left_no_end_or_failed_and_preemptions_are_not(tmp_path):
    hour = 3600.0
    record_start(tmp_path, step=0, nodes=2, now=0)  # killed: no end line
    record_start(tmp_path, step=40, nodes=2, now=1 * hour)
    record_end(tmp_path, step=90, outcome="preempted", now=3 * hour)
    record_start(tmp_path, step=90, nodes=2, now=4 * hour)
    record_end(tmp_path, step=95, outcome="failed", now=5 * hour)
    with open(tmp_path / ATTEMPTS_NAME, "a") as handle:
        handle.write('{"event": "start", "ti')  # cut short by the failure it would have recorded
    record_start(tmp_path, step=95, nodes=2, now=6 * hour)  # the attempt in progress: not counted
    history = read_history(tmp_path)
    assert history.failures == 2
    assert history.node_hours == pytest.approx(2 * (1 + 2 + 1))
    assert history.node_mtbf_hours(prior_hours=24) == pytest.approx((24 + 8) / 3)


def test_no_history_leaves_the_configured_mtbf():
    assert FailureHistory().node_mtbf_hours(prior_hours=24) == 24


def test_auto_without_an_mtbf_is_refused_naming_the_key_and_the_fix():
    with pytest.raises(
        ConfigError, match=r"checkpoint.every_steps=auto .*checkpoint.mtbf_hours is not set.*mtbf_hours=24"
    ):
        load_config(None, ["checkpoint.every_steps=auto"])
    with pytest.raises(ConfigError, match=r"checkpoint.every_steps.*got -3; give a number of steps.*or auto"):
        load_config(None, ["checkpoint.every_steps=-3"])
    assert (
        load_config(None, ["checkpoint.every_steps=auto", "checkpoint.mtbf_hours=12"]).checkpoint.every_steps == "auto"
    )


# The simulated history: a run whose true save cost, step time and MTBF are known, failing at exponentially
# distributed times; each attempt plans from the failure history so far, as a run resumed by the launcher does.
STEP_S, SAVE_S, MTBF_S, RESTART_S = 10.0, 30.0, 4 * 3600.0, 60.0


@dataclass
class Simulated:
    """Time lost, over all the time run, on one failure history."""

    lost: float
    failures: int


def simulate(
    interval: Callable[[FailureHistory], AutoInterval | int], *, seed: int = 0, hours: float = 4000
) -> Simulated:
    """Runs attempt after attempt until ``hours``; each gets its interval from ``interval(history so far)``:
    an AutoInterval fed noisy measured costs, or a fixed number of steps."""
    failures_rng, cost_rng = random.Random(seed), random.Random(seed + 1)
    horizon, now, kept, history = hours * 3600, 0.0, 0.0, FailureHistory()
    next_failure = failures_rng.expovariate(1 / MTBF_S)
    while now < horizon:
        choice, started, step, pending = interval(history), now, 0, 0.0
        while True:
            steps = 1 if isinstance(choice, AutoInterval) and choice.plan is None else _steps(choice)
            cost = SAVE_S * cost_rng.lognormvariate(0, 0.2)
            if next_failure < now + steps * STEP_S + cost:  # fails before this interval's save is complete
                now = next_failure + RESTART_S
                history = FailureHistory(history.failures + 1, history.node_hours + (now - started) / 3600)
                next_failure = now + failures_rng.expovariate(1 / MTBF_S)
                break
            now, step, pending = now + steps * STEP_S + cost, step + steps, pending + steps * STEP_S
            kept, pending = kept + pending, 0.0
            if isinstance(choice, AutoInterval):
                choice.saved(step, save_cost_s=cost, step_time_s=STEP_S * cost_rng.lognormvariate(0, 0.05))
            if now >= horizon:
                break
    return Simulated(lost=1 - kept / now, failures=history.failures)


def _steps(choice: AutoInterval | int) -> int:
    if isinstance(choice, int):
        return choice
    assert choice.plan is not None
    return choice.plan.steps


def young_daly_optimum(history: FailureHistory) -> int:
    """The interval Young/Daly gives from the true save cost and MTBF, which the run does not know."""
    return round(young_daly_seconds(save_cost_s=SAVE_S, mtbf_s=MTBF_S) / STEP_S)


@pytest.mark.parametrize("configured_hours", [4.0, 16.0, 1.0], ids=["right", "4x-too-high", "4x-too-low"])
def test_auto_loses_within_10_percent_of_the_young_daly_optimum_on_a_simulated_failure_history(configured_hours):
    def auto(history: FailureHistory) -> AutoInterval:
        return AutoInterval(mtbf_s=history.node_mtbf_hours(prior_hours=configured_hours) * 3600, restart_s=RESTART_S)

    optimum, measured = simulate(young_daly_optimum), simulate(auto)
    assert measured.failures > 500  # enough failures that the comparison is not luck
    assert measured.lost <= 1.10 * optimum.lost, (measured.lost, optimum.lost)
    # and the optimum itself loses what the model predicts
    predicted = expected_loss_rate(
        interval_s=young_daly_optimum(FailureHistory()) * STEP_S, save_cost_s=SAVE_S, mtbf_s=MTBF_S, restart_s=RESTART_S
    )
    assert math.isclose(optimum.lost, predicted, rel_tol=0.15), (optimum.lost, predicted)


def test_the_attempts_file_holds_one_json_object_a_line(tmp_path):
    record_start(tmp_path, step=0, nodes=1, now=1.0)
    record_end(tmp_path, step=3, outcome="success", now=2.0)
    lines = [json.loads(line) for line in (tmp_path / ATTEMPTS_NAME).read_text().splitlines()]
    assert lines == [
        {"event": "start", "time": 1.0, "step": 0, "nodes": 1},
        {"event": "end", "time": 2.0, "step": 3, "outcome": "success"},
    ]
