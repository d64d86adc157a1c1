"""What the trainer needs to run a pipeline layout on this rank: the model part, the stage modules
and the engine. Imported only when the layout has a pipeline (torch.distributed.pipelining loads
torch._dynamo, which every other layout would pay for at start-up)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from paratrain.config.schema import PipelineConfig, TrainConfig
from paratrain.layout.request import LaidOutModel, LayoutRequest
from paratrain.models.contract import warn_misspelt_hooks
from paratrain.parallel.collectives import broadcast_object
from paratrain.parallel.dims import ParallelDims, micro_batch_size
from paratrain.parallel.pipeline.assembly import build_pipeline_stages, measure_piece_costs, pipeline_shape
from paratrain.parallel.pipeline.recorder import TimelineRecorder
from paratrain.parallel.pipeline.schedule_engine import PipelineEngine
from paratrain.parallel.pipeline.schedules import PipelineShape

logger = logging.getLogger("paratrain")


def build_pipeline_runtime(request: LayoutRequest) -> LaidOutModel:
    """This rank's stages and the schedule's engine."""
    dims, ctx, pipeline, train = request.dims, request.ctx, request.pipeline, request.train
    shape = pipeline_shape(pipeline, dims=dims, train=train)
    costs = _measured_piece_costs(
        request.model_factory,
        pipeline,
        request.sample_dataset,
        train=train,
        dims=dims,
        device=ctx.device,
        is_main=ctx.rank == 0,
    )
    part = build_pipeline_stages(
        request.model_factory,
        dims,
        parallel=request.parallel,
        pipeline=pipeline,
        shape=shape,
        device=ctx.device,
        seed=train.seed,
        autocast=request.precision.autocast,
        costs=costs,
        pretrained=request.pretrained,
        sequence=request.sequence,
        resuming=request.resuming,
        seed_checkpoint_dir=request.seed_checkpoint_dir,
    )
    if ctx.rank == 0:
        warn_misspelt_hooks(part.model)
    logger.info(
        "pipeline %s; this rank holds stage(s) %s: %s",
        shape.describe(),
        part.indices,
        "; ".join(", ".join(part.stages[i]) for i in part.indices),
    )
    recorder = (
        _timeline_recorder(shape, request.timeline_dir, dims=dims, rank=ctx.rank, device=ctx.device)
        if records_timeline(pipeline, ctx.device)
        else None
    )
    engine = PipelineEngine(
        part.modules,
        part.indices,
        shape,
        loss_fn=request.loss_fn,
        group=dims.pp_mesh.get_group(),
        device=ctx.device,
        recorder=recorder,
        sequence=request.sequence,
        # Every stage's ranks count the step's targets: the loss mesh spans the stages, whose counts add pp times.
        loss_group=dims.loss_mesh.get_group() if dims.loss_mesh is not None else None,
        loss_ranks=dims.loss_ranks * dims.pp,
    )
    return LaidOutModel(part.model, nn.ModuleList(part.modules), engine, request.sequence)


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


def records_timeline(options: PipelineConfig, device: torch.device) -> bool:
    """pipeline.record_timeline, or by default only off the GPU: the recorder synchronises the
    device after each action, which on a GPU would serialise compute and communication."""
    if options.record_timeline is not None:
        return options.record_timeline
    return device.type != "cuda"


def _timeline_recorder(
    shape: PipelineShape, directory: Path, *, dims: ParallelDims, rank: int, device: torch.device
) -> TimelineRecorder:
    describe = {
        "replica": dims.dp_rank,
        "pp_rank": dims.pp_rank,
        "schedule": shape.schedule,
        "pp": shape.pp,
        "stages_per_rank": shape.stages_per_rank,
        "microbatches": shape.microbatches,
    }
    return TimelineRecorder(
        directory / f"timeline-rank{rank}.json",
        rank=rank,
        group=dims.pp_mesh.get_group(),
        device=device,
        describe=describe,
    )
