"""How often to save under ``checkpoint.every_steps: auto``: Young/Daly's interval, from what this run's saves
cost and how often the run fails.

A failure loses the work since the last checkpoint, half an interval on average, plus the restart; a save costs
its blocking time, once per interval. Per unit of time the run then loses about

    save_cost / interval + (interval / 2 + restart) / mtbf

which is least at ``interval = sqrt(2 * save_cost * mtbf)`` (Young 1974; Daly 2006 adds higher-order terms that
matter only when a save takes a sizeable part of the MTBF). ``save_cost`` is measured: the time each periodic
save blocked training (for an asynchronous save, its staging, plus any wait for the previous one still being
written, which so pushes the interval past the background write). ``mtbf`` is the whole run's: a node's
(``checkpoint.mtbf_hours``, refined by the run directory's history: ``run_history``) over the number of nodes.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

DRIFT = 0.25  # re-plan when the save cost or step time moves this far from the plan's
_RECENT = 5  # saves whose median is the save cost: one slow save (a busy disk) does not re-plan alone


def young_daly_seconds(*, save_cost_s: float, mtbf_s: float) -> float:
    """The interval between saves that loses least: sqrt(2 x save cost x MTBF)."""
    return math.sqrt(2 * save_cost_s * mtbf_s)


def expected_loss_rate(*, interval_s: float, save_cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """The fraction of time lost to saving and to failures at this interval (see the module's docstring)."""
    return save_cost_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s


@dataclass(frozen=True)
class IntervalPlan:
    """An interval chosen from measurements (a run's) or estimates (``paratrain plan``'s).

    Attributes:
        seconds: Training time between saves.
        save_cost_s: The time a save blocks training.
        mtbf_s: Mean time between failures of the whole run.
        restart_s: The known part of a restart (this run's resume), added to what a failure loses.
        steps: The interval in whole steps, for a run; None for an estimate in time alone.
        step_time_s: The measured time of a step, without saves, that turned seconds into steps.
    """

    seconds: float
    save_cost_s: float
    mtbf_s: float
    restart_s: float = 0.0
    steps: int | None = None
    step_time_s: float | None = None

    @property
    def lost_per_failure_s(self) -> float:
        """Expected training time a failure costs: half an interval redone, plus the restart."""
        return self.seconds / 2 + self.restart_s

    @property
    def overhead(self) -> float:
        """Time spent saving over time spent training."""
        return self.save_cost_s / self.seconds

    def describe(self, *, previous: IntervalPlan | None = None) -> str:
        """The plan as rank 0 logs it; with ``previous``, also what changed since that one."""
        again = ""
        if previous is not None:
            again = (
                f" (planned again: save cost {previous.save_cost_s:.3g} s -> {self.save_cost_s:.3g} s, step time "
                f"{previous.step_time_s or 0:.3g} s -> {self.step_time_s or 0:.3g} s)"
            )
        return self._describe() + again

    def _describe(self) -> str:
        optimum = young_daly_seconds(save_cost_s=self.save_cost_s, mtbf_s=self.mtbf_s)
        rule = f"Young/Daly sqrt(2 x {self.save_cost_s:.3g} s save x {self.mtbf_s / 3600:.3g} h MTBF)"
        every = f"every {_duration(self.seconds)} ({rule})"
        if self.steps is not None:
            every = f"every {self.steps} steps ({_duration(self.seconds)}; {rule} = {_duration(optimum)} at {self.step_time_s:.3g} s a step)"
        return (
            f"{every}; expected lost time per failure {_duration(self.lost_per_failure_s)}; checkpoint overhead "
            f"{100 * self.overhead:.2f} %"
        )


def plan_interval(
    *, save_cost_s: float, mtbf_s: float, restart_s: float = 0.0, step_time_s: float | None = None
) -> IntervalPlan:
    """The Young/Daly interval; in whole steps (at least one) when ``step_time_s`` is given."""
    seconds = young_daly_seconds(save_cost_s=save_cost_s, mtbf_s=mtbf_s)
    if step_time_s is None:
        return IntervalPlan(seconds, save_cost_s, mtbf_s, restart_s)
    steps = max(1, round(seconds / step_time_s))
    return IntervalPlan(steps * step_time_s, save_cost_s, mtbf_s, restart_s, steps, step_time_s)


class AutoInterval:
    """Decides when a run under ``every_steps: auto`` saves; the same on every rank, given the same numbers.

    The first save comes after the first step: it measures what a save costs. Each later save comes
    ``plan.steps`` after the previous one; after each, ``saved`` takes its measured cost and the steps' time
    and plans again when either drifted past ``DRIFT`` from the plan's.

    Args:
        mtbf_s: Mean time between failures of the whole run.
        restart_s: The measured part of a restart (see IntervalPlan).
    """

    def __init__(self, *, mtbf_s: float, restart_s: float = 0.0):
        self.mtbf_s, self.restart_s = mtbf_s, restart_s
        self.plan: IntervalPlan | None = None
        self._last_saved: int | None = None
        self._costs: list[float] = []

    def due(self, step: int) -> bool:
        """Whether a periodic save follows ``step``."""
        if self._last_saved is None:
            return True
        return self.plan is not None and self.plan.steps is not None and step - self._last_saved >= self.plan.steps

    def saved(self, step: int, *, save_cost_s: float, step_time_s: float) -> IntervalPlan | None:
        """Records the save after ``step``: the time it blocked, and the mean time of the steps before it (no
        save included). Returns the new plan when it planned again, else None."""
        self._last_saved = step
        self._costs = [*self._costs, save_cost_s][-_RECENT:]
        candidate = plan_interval(
            save_cost_s=statistics.median(self._costs),
            step_time_s=step_time_s,
            mtbf_s=self.mtbf_s,
            restart_s=self.restart_s,
        )
        if self.plan is not None and not _drifted(self.plan, candidate):
            return None
        self.plan = candidate
        return candidate


def _drifted(plan: IntervalPlan, measured: IntervalPlan) -> bool:
    pairs = ((plan.save_cost_s, measured.save_cost_s), (plan.step_time_s or 0.0, measured.step_time_s or 0.0))
    return any(abs(new - old) > DRIFT * old for old, new in pairs)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
