"""What the trainer needs to run a pipeline layout on this rank: the model part, the stage modules
and the engine. Imported only when the layout has a pipeline (torch.distributed.pipelining loads
torch._dynamo, which every other layout would pay for at start-up)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import Dataset

from paratrain.builders import micro_batch_size
from paratrain.config.schema import ParallelConfig, PipelineConfig, TrainConfig
from paratrain.engine import LossFn
from paratrain.parallel.collectives import broadcast_object
from paratrain.parallel.dims import ParallelDims
from paratrain.parallel.pipeline.build import PipelineModel, build_pipeline_model, measure_piece_costs, pipeline_shape
from paratrain.parallel.pipeline.engine import PipelineEngine
from paratrain.parallel.pipeline.recorder import TimelineRecorder

logger = logging.getLogger("paratrain")


@dataclass(frozen=True)
class PipelineRuntime:
    bare: nn.Module  # this rank's pieces under the model's names: what checkpoints and the optimizer see
    stage_modules: list[nn.Module]
    engine: PipelineEngine


def build_pipeline_runtime(
    model_factory: Callable[[], nn.Module],
    loss_fn: LossFn,
    *,
    parallel: ParallelConfig,
    pipeline: PipelineConfig,
    train: TrainConfig,
    output_dir: Path,
    dims: ParallelDims,
    mesh: DeviceMesh,
    device: torch.device,
    rank: int,
    dp_rank: int,
    dataset: Dataset,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> PipelineRuntime:
    shape = pipeline_shape(pipeline, dims=dims, train=train)
    costs = _measured_piece_costs(
        model_factory, pipeline, dataset, train=train, dims=dims, device=device, is_main=rank == 0
    )
    part = build_pipeline_model(
        model_factory,
        parallel,
        pipeline,
        shape=shape,
        dims=dims,
        mesh=mesh,
        device=device,
        seed=train.seed,
        autocast=autocast,
        costs=costs,
    )
    logger.info(
        "pipeline %s; this rank holds stage(s) %s: %s",
        shape.describe(),
        part.stage_indices,
        "; ".join(", ".join(part.stages[i]) for i in part.stage_indices),
    )
    recorder = (
        _timeline_recorder(part, output_dir, rank=rank, dp_rank=dp_rank, mesh=mesh, device=device)
        if pipeline.record_timeline
        else None
    )
    engine = PipelineEngine(
        part.stage_modules,
        part.stage_indices,
        shape,
        loss_fn=loss_fn,
        group=mesh["pp"].get_group(),
        device=device,
        recorder=recorder,
    )
    return PipelineRuntime(part.bare, part.stage_modules, engine)


def _measured_piece_costs(
    model_factory: Callable[[], nn.Module],
    pipeline: PipelineConfig,
    dataset: Dataset,
    *,
    train: TrainConfig,
    dims: ParallelDims,
    device: torch.device,
    is_main: bool,
) -> list[float] | None:
    """pipeline.balance=time: rank 0 times each piece on a micro-batch, and every rank cuts by its numbers."""
    if pipeline.balance != "time":
        return None
    costs = None
    if is_main:
        sample = torch.stack([dataset[index][0] for index in range(micro_batch_size(train, pipeline, dims=dims))])
        costs = measure_piece_costs(model_factory, sample, device=device, seed=train.seed)
        logger.info(
            "pipeline.balance=time: seconds per piece (forward + backward): %s",
            ", ".join(f"{cost:.4f}" for cost in costs),
        )
    return broadcast_object(costs)


def _timeline_recorder(
    part: PipelineModel, output_dir: Path, *, rank: int, dp_rank: int, mesh: DeviceMesh, device: torch.device
) -> TimelineRecorder:
    shape = part.shape
    describe = {
        "replica": dp_rank,
        "pp_rank": mesh["pp"].get_local_rank(),
        "schedule": shape.schedule,
        "pp": shape.pp,
        "stages_per_rank": shape.stages_per_rank,
        "microbatches": shape.microbatches,
    }
    return TimelineRecorder(
        output_dir / "pipeline" / f"timeline-rank{rank}.json",
        rank=rank,
        group=mesh["pp"].get_group(),
        device=device,
        describe=describe,
    )
