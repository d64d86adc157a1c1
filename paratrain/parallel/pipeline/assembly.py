"""Building this rank's part of a pipeline: which stages, cut where, with which layout inside.

Order: the model on meta; cut into stages and keep this rank's pieces; one StageModule per kept stage;
``parallelize`` (the same function and order as every other layout) on the kept blocks, with the stage
modules as FSDP roots; materialise; DDP around each stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from paratrain.config.schema import ParallelConfig, PipelineConfig, TrainConfig
from paratrain.models.init import build_whole, materialize
from paratrain.models.meta import on_meta
from paratrain.models.plan_derivation import plan_of
from paratrain.parallel.dims import ParallelDims
from paratrain.parallel.parallelize import maybe_wrap_replicas, parallelize
from paratrain.parallel.pipeline.schedules import SPLIT_BACKWARD, PipelineShape, default_stages_per_rank
from paratrain.parallel.pipeline.split import Stage, cut_stages, measured_costs, pipeline_sequence
from paratrain.parallel.pipeline.stages import keep_only, stage_modules
from paratrain.parallel.sequence_sharding import SequenceSharding


@dataclass(frozen=True)
class PipelineStages:
    """This rank's share of a pipeline.

    Attributes:
        model: The model with other ranks' pieces removed; parameters keep the model's names.
        modules: What the schedule runs, one per stage this rank holds (DDP-wrapped once built).
        indices: Those stages' positions in the pipeline.
        stages: Every stage's pieces, by stage index (the same on all ranks).
        shape: The schedule's shape.
    """

    model: nn.Module
    modules: list[nn.Module]
    indices: list[int]
    stages: list[Stage]
    shape: PipelineShape


def pipeline_shape(options: PipelineConfig, *, dims: ParallelDims, train: TrainConfig) -> PipelineShape:
    """The schedule at this layout; micro-batches per step are pipeline.microbatches, or what
    global_batch_size / (micro_batch_size x data-parallel size) implies."""
    microbatches = options.microbatches or train.global_batch_size // (train.micro_batch_size * dims.dp)
    stages_per_rank = options.stages_per_rank or default_stages_per_rank(options.schedule)
    return PipelineShape(options.schedule, dims.pp, stages_per_rank, microbatches)


def build_pipeline_stages(
    factory: Callable[[], nn.Module],
    dims: ParallelDims,
    *,
    parallel: ParallelConfig,
    pipeline: PipelineConfig,
    shape: PipelineShape,
    device: torch.device,
    seed: int,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    costs: list[float] | None = None,
    pretrained: Path | None = None,
    sequence: SequenceSharding | None = None,
    resuming: bool = False,
    seed_checkpoint_dir: Path | None = None,
) -> PipelineStages:
    """This rank's stages, laid out, initialised and wrapped (see module docstring).

    Args:
        costs: Per-piece costs to balance stages by (pipeline.balance=time); None: parameter counts.
        resuming, seed_checkpoint_dir: As for ``models.init.materialize``.
    """
    laid = lay_out_stages(
        factory,
        dims,
        parallel=parallel,
        pipeline=pipeline,
        shape=shape,
        autocast=autocast,
        costs=costs,
        sequence=sequence,
    )
    materialize(
        laid.model,
        factory=factory,
        device=device,
        seed=seed,
        pretrained=pretrained,
        allocate_via=laid.modules,
        resuming=resuming,
        seed_checkpoint_dir=seed_checkpoint_dir,
    )
    modules = [
        maybe_wrap_replicas(module, dims, options=parallel, device=device, in_pipeline=True) for module in laid.modules
    ]
    return replace(laid, modules=modules)


def lay_out_stages(
    factory: Callable[[], nn.Module],
    dims: ParallelDims,
    *,
    parallel: ParallelConfig,
    pipeline: PipelineConfig,
    shape: PipelineShape,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    costs: list[float] | None = None,
    pretrained: Path | None = None,
    sequence: SequenceSharding | None = None,
) -> PipelineStages:
    """The model on meta, cut into stages, this rank's kept and parallelized (the dry run stops here)."""
    if parallel.compile and shape.schedule in SPLIT_BACKWARD:
        # A compiled backward donates its saved buffers and then refuses a second backward over the same
        # graph ("compiled with non-empty donated buffers which requires ... retain_graph=False"), which
        # is what the weight-gradient half of a split backward is. Keeping the buffers costs memory, not
        # speed; torch's message names this setting as the fix.
        torch._functorch.config.donated_buffer = False
    with on_meta():
        model = factory()
    plan = plan_of(model)
    stages = cut_stages(model, pipeline, shape.num_stages, costs)
    mine = shape.stages_of_rank(dims.pp_rank)
    kept = {path for index in mine for path in stages[index]}
    keep_only(model, pipeline_sequence(model), kept)
    local_plan = replace(
        plan,
        blocks=tuple(block for block in plan.blocks if _inside(block, kept)),
        outer_units=tuple(group for group in plan.outer_units if all(_inside(path, kept) for path in group)),
    )
    # Stage modules hold the kept pieces as they are once wrapped (activation checkpointing replaces
    # blocks); FSDP then shards the blocks and each stage as a root.
    modules = parallelize(
        model,
        dims,
        plan=local_plan,
        options=parallel,
        roots=lambda laid_out: stage_modules(
            laid_out, [stages[index] for index in mine], autocast, plan.pipeline_layer_inputs
        ),
        sequence=sequence,
    )
    return PipelineStages(model, modules, mine, stages, shape)


def _inside(path: str, kept: set[str]) -> bool:
    return any(path == piece or path.startswith(piece + ".") for piece in kept)


def measure_piece_costs(
    factory: Callable[[], nn.Module], sample: torch.Tensor, *, device: torch.device, seed: int
) -> list[float]:
    """pipeline.balance=time: each piece's forward + backward time on one micro-batch, measured on a
    whole copy of the model (so the measuring rank briefly holds all of it; preflight refuses it above a size)."""
    model = build_whole(factory, device=device, seed=seed)
    sequence = pipeline_sequence(model)
    pieces = stage_modules(
        model, [[path] for path in sequence], contextlib.nullcontext, plan_of(model).pipeline_layer_inputs
    )
    return measured_costs(pieces, sample.to(device))
