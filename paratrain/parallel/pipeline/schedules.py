"""The pipeline schedules paratrain offers: torch's own, named as torch names them.

Everything here is about the schedule as a plan (which stages a rank holds, which actions it runs in
which order); nothing runs a model. The action tables come from torch itself
(``_schedule_visualizer.get_schedule_ops``), so what ``paratrain pipeline show`` draws is what the
schedule class will execute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from paratrain.errors import ConfigError

ScheduleName = Literal[
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
]

_COMPUTE = (
    _ComputationType.FORWARD,
    _ComputationType.FULL_BACKWARD,
    _ComputationType.BACKWARD_INPUT,
    _ComputationType.BACKWARD_WEIGHT,
    _ComputationType.OVERLAP_F_B,
)

# V-shaped schedules place stage r and stage 2p-1-r on rank r, so the first and last stages share a rank.
_V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
# Schedules that run a stage's backward in two halves (input gradients, then weight gradients later),
# keeping the autograd graph alive between them (retain_graph).
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class PipelineShape:
    """A schedule at a pipeline degree: p ranks, v stages on each, m micro-batches per step."""

    schedule: ScheduleName
    pp: int
    stages_per_rank: int
    microbatches: int

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stage_to_rank(self) -> dict[int, int]:
        return generate_stage_to_rank_mapping(self.pp, self.num_stages, style="v" if self.is_v_shaped else "loop")

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        return [stage for stage, rank in sorted(self.stage_to_rank().items()) if rank == pp_rank]

    @property
    def is_v_shaped(self) -> bool:
        return self.schedule in _V_SHAPED

    def describe(self) -> str:
        return f"{self.schedule}, p={self.pp}, v={self.stages_per_rank}, m={self.microbatches}"


def schedule_class(name: str) -> type:
    return torch_schedules.get_schedule_class(name)


def is_multi_stage(name: str) -> bool:
    """Whether the schedule runs several stages per rank (looped and V-shaped ones)."""
    return issubclass(schedule_class(name), torch_schedules.PipelineScheduleMulti)


def default_stages_per_rank(name: str) -> int:
    return 2 if is_multi_stage(name) else 1


def check_shape(shape: PipelineShape) -> None:
    """Raises ConfigError when the schedule cannot run this shape, naming the keys to change."""
    name, v = shape.schedule, shape.stages_per_rank
    if shape.is_v_shaped and v != 2:
        raise ConfigError(
            f"pipeline.schedule={name} needs exactly 2 stages per rank (V shape), but "
            f"pipeline.stages_per_rank={v}; set pipeline.stages_per_rank=2"
        )
    if is_multi_stage(name) and v < 2:
        raise ConfigError(
            f"pipeline.schedule={name} runs several stages per rank, but pipeline.stages_per_rank={v}; "
            f"set it to 2 or more, or use GPipe or 1F1B for one stage per rank"
        )
    if not is_multi_stage(name) and v != 1:
        raise ConfigError(
            f"pipeline.schedule={name} runs one stage per rank, but pipeline.stages_per_rank={v}; "
            f"use Interleaved1F1B, LoopedBFS, InterleavedZeroBubble or ZBVZeroBubble for several"
        )
    try:
        action_table(shape)
    except (AssertionError, ValueError, RuntimeError) as error:
        raise ConfigError(
            f"pipeline.schedule={name} cannot run pipeline.microbatches={shape.microbatches} over "
            f"parallel.pp={shape.pp} with {v} stage(s) per rank: torch says {error}"
        ) from None


def action_table(shape: PipelineShape) -> list[list[_Action]]:
    """Each pp rank's compute actions in execution order (torch ``_Action``s: stage, type, micro-batch).

    Multi-stage schedules execute torch's own ``pipeline_order``, so that is read as is. GPipe and
    1F1B run their own loops (``_step_microbatches``) and their ``pipeline_order`` is only a picture
    (in torch 2.13 it numbers the last rank's 1F1B micro-batches from 1), so their orders are written
    out here as those loops run them.
    """
    if shape.schedule in ("GPipe", "1F1B"):
        _instantiate_for_validation(shape)
        order = _gpipe_order if shape.schedule == "GPipe" else _one_f_one_b_order
        return [order(rank, shape.pp, shape.microbatches) for rank in range(shape.pp)]

    table = get_schedule_ops(shape.schedule, shape.pp, shape.microbatches, num_stages_per_rank=shape.stages_per_rank)
    return [[action for action in rank if action is not None and action.computation_type in _COMPUTE] for rank in table]


def _gpipe_order(rank: int, pp: int, microbatches: int) -> list[_Action]:
    return [_Action(rank, _ComputationType.FORWARD, mb) for mb in range(microbatches)] + [
        _Action(rank, _ComputationType.FULL_BACKWARD, mb) for mb in range(microbatches)
    ]


def _one_f_one_b_order(rank: int, pp: int, microbatches: int) -> list[_Action]:
    """Schedule1F1B: stage r runs min(m, p - r) forwards, then alternates backward and forward."""
    warmup = min(microbatches, pp - rank)
    actions = [_Action(rank, _ComputationType.FORWARD, mb) for mb in range(warmup)]
    for backward in range(microbatches):
        actions.append(_Action(rank, _ComputationType.FULL_BACKWARD, backward))
        if warmup + backward < microbatches:
            actions.append(_Action(rank, _ComputationType.FORWARD, warmup + backward))
    return actions


def _instantiate_for_validation(shape: PipelineShape) -> None:
    """Lets torch's constructor refuse shapes it cannot run (e.g. 1F1B with fewer micro-batches than stages)."""

    get_schedule_ops(shape.schedule, shape.pp, shape.microbatches, num_stages_per_rank=shape.stages_per_rank)
