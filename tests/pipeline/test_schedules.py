"""Schedule tables, without timing: the bubble each schedule's action order implies when every stage
costs the same. GPipe and 1F1B must give exactly (p-1)/(m+p-1); the interleaved and zero-bubble
schedules must do better at the same p and m."""

from __future__ import annotations

from fractions import Fraction

import pytest
from torch.distributed.pipelining.schedules import _ComputationType as Kind

from paratrain.parallel.pipeline.schedules import PipelineShape, action_table
from paratrain.parallel.pipeline.timeline import simulate

SHAPES = [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (3, 6)]


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("pp,microbatches", SHAPES)
def test_gpipe_and_1f1b_idle_exactly_p_minus_1_over_m_plus_p_minus_1(schedule, pp, microbatches):
    timeline = simulate(PipelineShape(schedule, pp, 1, microbatches))
    assert timeline.idle_fraction() == Fraction(pp - 1, microbatches + pp - 1)


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"])
@pytest.mark.parametrize("pp,microbatches", [(2, 4), (2, 8), (4, 8)])
def test_multi_stage_schedules_idle_less_than_1f1b(schedule, pp, microbatches):
    one_f_one_b = simulate(PipelineShape("1F1B", pp, 1, microbatches)).idle_fraction()
    assert simulate(PipelineShape(schedule, pp, 2, microbatches)).idle_fraction() < one_f_one_b


def test_zero_bubble_beats_plain_interleaving():
    interleaved = simulate(PipelineShape("Interleaved1F1B", 4, 2, 8)).idle_fraction()
    assert simulate(PipelineShape("InterleavedZeroBubble", 4, 2, 8)).idle_fraction() < interleaved
    assert simulate(PipelineShape("ZBVZeroBubble", 4, 2, 8)).idle_fraction() < interleaved


@pytest.mark.parametrize(
    "schedule,stages_per_rank",
    [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2)],
)
def test_each_rank_runs_its_stages_forward_and_backward_once_per_micro_batch(schedule, stages_per_rank):
    shape = PipelineShape(schedule, 2, stages_per_rank, 4)
    for rank, actions in enumerate(action_table(shape)):
        expected = sorted((stage, mb) for stage in shape.stages_of_rank(rank) for mb in range(4))
        assert of_kind(actions, Kind.FORWARD) == expected
        assert of_kind(actions, Kind.FULL_BACKWARD, Kind.BACKWARD_INPUT) == expected
        assert of_kind(actions, Kind.BACKWARD_WEIGHT) == of_kind(actions, Kind.BACKWARD_INPUT)


def of_kind(actions, *kinds) -> list[tuple[int, int]]:
    return sorted((a.stage_index, a.microbatch_index) for a in actions if a.computation_type in kinds)


def test_1f1b_order_is_what_the_schedule_runs():
    """Schedule1F1B's first stage warms up with p forwards, the last alternates from the start."""
    table = action_table(PipelineShape("1F1B", 2, 1, 4))
    assert [str(action) for action in table[0]] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"]
    assert [str(action) for action in table[1]] == ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]
