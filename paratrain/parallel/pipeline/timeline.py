"""A schedule's timeline in theory: when each action would run if every stage cost the same.

Each rank runs its actions in the schedule's order; an action starts once its rank is free and the
actions it needs are done (a stage's forward needs the previous stage's forward of that micro-batch;
a backward needs its own forward and the next stage's input gradient; a weight-gradient action needs
its own input-gradient action). With uniform stages split v per rank, a forward costs 1/v, a full
backward 2/v, and the split backward's input and weight halves 1/v each. Communication costs nothing
here. Times are exact fractions, so the bubble of GPipe and 1F1B comes out as exactly
(p-1)/(m+p-1).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from torch.distributed.pipelining.schedules import _Action
from torch.distributed.pipelining.schedules import _ComputationType as Kind

from paratrain.parallel.pipeline.schedules import PipelineShape, action_table

_COST = {Kind.FORWARD: 1, Kind.FULL_BACKWARD: 2, Kind.BACKWARD_INPUT: 1, Kind.BACKWARD_WEIGHT: 1}
_INPUT_GRADIENT = (Kind.FULL_BACKWARD, Kind.BACKWARD_INPUT)
LETTER = {Kind.FORWARD: "F", Kind.FULL_BACKWARD: "B", Kind.BACKWARD_INPUT: "I", Kind.BACKWARD_WEIGHT: "W"}


@dataclass(frozen=True)
class Slot:
    """One action placed in time on one rank."""

    start: Fraction
    end: Fraction
    stage: int
    kind: str  # F, B (full backward), I (input gradient), W (weight gradient)
    microbatch: int


@dataclass(frozen=True)
class Timeline:
    """Every rank's slots over one step; the step lasts from 0 to ``makespan``."""

    ranks: list[list[Slot]]
    makespan: Fraction

    def busy(self, rank: int) -> Fraction:
        return sum((slot.end - slot.start for slot in self.ranks[rank]), Fraction(0))

    def idle_fraction(self) -> Fraction:
        """Share of all ranks' time spent idle: the pipeline bubble."""
        total = self.makespan * len(self.ranks)
        return 1 - sum((self.busy(rank) for rank in range(len(self.ranks))), Fraction(0)) / total


def simulate(shape: PipelineShape) -> Timeline:
    """Places every rank's actions (from ``action_table``) in time; raises if the order deadlocks."""
    queues = [_flatten(rank_actions) for rank_actions in action_table(shape)]
    unit = Fraction(1, shape.stages_per_rank)
    done: dict[tuple[int, Kind, int], Fraction] = {}
    free = [Fraction(0)] * shape.pp
    placed: list[list[Slot]] = [[] for _ in range(shape.pp)]
    positions = [0] * shape.pp
    while any(positions[r] < len(queues[r]) for r in range(shape.pp)):
        progressed = False
        for rank in range(shape.pp):
            while positions[rank] < len(queues[rank]):
                action = queues[rank][positions[rank]]
                ready = _ready_time(action, done, num_stages=shape.num_stages)
                if ready is None:
                    break
                start = max(free[rank], ready)
                end = start + _COST[action.computation_type] * unit
                done[(action.stage_index, action.computation_type, action.microbatch_index)] = end
                placed[rank].append(
                    Slot(start, end, action.stage_index, LETTER[action.computation_type], action.microbatch_index)
                )
                free[rank], positions[rank], progressed = end, positions[rank] + 1, True
        if not progressed:
            raise RuntimeError(f"schedule {shape.describe()} deadlocks in simulation")
    return Timeline(placed, max(free))


def theoretical_bubble(pp: int, microbatches: int, stages_per_rank: int = 1) -> Fraction:
    """The textbook bubble (p-1)/(v*m + p-1): exact for GPipe and 1F1B (v=1), approximate for
    interleaved schedules."""
    return Fraction(pp - 1, stages_per_rank * microbatches + pp - 1)


def render_text(timeline: Timeline) -> str:
    """One line per rank: each unit of time as the action's letter and micro-batch, '.' when idle."""
    # The finest time step present, so every slot is a whole number of columns.
    step = min(slot.end - slot.start for rank in timeline.ranks for slot in rank)
    columns = int(timeline.makespan / step)
    lines = []
    for rank, slots in enumerate(timeline.ranks):
        cells = ["  .  "] * columns
        for slot in slots:
            first, last = int(slot.start / step), int(slot.end / step)
            for column in range(first, last):
                label = f"{slot.stage}{slot.kind}{slot.microbatch}"
                cells[column] = f"{label:<5}" if column == first else f"{'~':<5}"
        lines.append(f"rank {rank}: " + "".join(cells))
    legend = (
        "one column per time unit of a forward on one stage; <stage><F|B|I|W><micro-batch> starts an "
        "action, ~ continues it, . is idle (F forward, B full backward, I input gradient, W weight gradient)"
    )
    return "\n".join(lines) + "\n" + legend


def _flatten(actions: list[_Action]) -> list[_Action]:
    """DualPipeV's overlapped forward+backward pairs run here one after the other."""
    flat = []
    for action in actions:
        if action.computation_type == Kind.OVERLAP_F_B:
            flat.extend(action.sub_actions)
        else:
            flat.append(action)
    return flat


def _ready_time(action: _Action, done: dict, *, num_stages: int) -> Fraction | None:
    """When the actions this one needs are all done, or None if one of them has not been placed."""
    stage, kind, mb = action.stage_index, action.computation_type, action.microbatch_index
    needs: list[tuple[int, Kind, int] | tuple[tuple[int, Kind, int], ...]] = []
    if kind == Kind.FORWARD and stage > 0:
        needs.append((stage - 1, Kind.FORWARD, mb))
    if kind in _INPUT_GRADIENT:
        needs.append((stage, Kind.FORWARD, mb))
        if stage < num_stages - 1:
            needs.append(tuple((stage + 1, k, mb) for k in _INPUT_GRADIENT))  # either kind of the next stage
    if kind == Kind.BACKWARD_WEIGHT:
        needs.append((stage, Kind.BACKWARD_INPUT, mb))
    times = []
    for need in needs:
        options = need if isinstance(need[0], tuple) else (need,)
        found = [done[key] for key in options if key in done]
        if not found:
            return None
        times.append(found[0])
    return max(times, default=Fraction(0))
