"""Building this rank's part of a pipeline: which stages, cut where, with which layout inside.

Order, as for the other layouts: the model on meta; cut into stages and keep this rank's pieces;
tensor parallel, activation checkpointing and compile on the kept blocks; one StageModule per kept
stage; FSDP on the kept blocks then on each stage; materialise; DDP around each stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from paratrain.config.schema import ParallelConfig, PipelineConfig, TrainConfig
from paratrain.models.init import materialize
from paratrain.models.plan import ParallelPlan, plan_of
from paratrain.parallel.activation import apply_activation_checkpointing, apply_compile
from paratrain.parallel.ddp import apply_ddp
from paratrain.parallel.dims import ParallelDims
from paratrain.parallel.fsdp import apply_fsdp
from paratrain.parallel.pipeline.schedules import PipelineShape, default_stages_per_rank
from paratrain.parallel.pipeline.split import Stage, cut_stages, measured_costs, pipeline_sequence
from paratrain.parallel.pipeline.stages import StageModule, keep_only, stage_modules
from paratrain.parallel.tensor import apply_tensor_parallel, check_tensor_parallel_plan


@dataclass(frozen=True)
class PipelineModel:
    """This rank's share of a pipeline.

    Attributes:
        bare: The model with other ranks' pieces removed; parameters keep the model's names.
        stage_modules: What the schedule runs, one per stage this rank holds (maybe DDP/FSDP-wrapped).
        stage_indices: Those stages' positions in the pipeline.
        stages: Every stage's pieces, by stage index (the same on all ranks).
    """

    bare: nn.Module
    stage_modules: list[nn.Module]
    stage_indices: list[int]
    shape: PipelineShape
    stages: list[Stage]


def pipeline_shape(options: PipelineConfig, *, dims: ParallelDims, train: TrainConfig) -> PipelineShape:
    """The schedule at this layout; micro-batches per step are pipeline.microbatches, or what
    global_batch_size / (micro_batch_size x data-parallel size) implies."""
    microbatches = options.microbatches or train.global_batch_size // (train.micro_batch_size * dims.dp)
    stages_per_rank = options.stages_per_rank or default_stages_per_rank(options.schedule)
    return PipelineShape(options.schedule, dims.pp, stages_per_rank, microbatches)


@dataclass(frozen=True)
class StagesOnMeta:
    """This rank's stages laid out on the meta device: everything but materialising and DDP."""

    model: nn.Module
    modules: list[nn.Module]
    indices: list[int]
    stages: list[Stage]


def build_pipeline_model(
    factory: Callable[[], nn.Module],
    options: ParallelConfig,
    pipeline: PipelineConfig,
    *,
    shape: PipelineShape,
    dims: ParallelDims,
    mesh: DeviceMesh,
    device: torch.device,
    seed: int,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    costs: list[float] | None = None,
) -> PipelineModel:
    """This rank's stages, laid out and initialised (see module docstring).

    Args:
        costs: Per-piece costs to balance stages by (pipeline.balance=time); None: parameter counts.
    """
    laid = lay_out_stages(factory, options, pipeline, shape=shape, dims=dims, mesh=mesh, autocast=autocast, costs=costs)
    materialize(laid.model, device=device, seed=seed, allocate_via=laid.modules)
    modules = laid.modules
    if options.strategy == "ddp":
        modules = [_ddp(module, options, mesh=mesh, device=device) for module in modules]
    return PipelineModel(laid.model, modules, laid.indices, shape, laid.stages)


def lay_out_stages(
    factory: Callable[[], nn.Module],
    options: ParallelConfig,
    pipeline: PipelineConfig,
    *,
    shape: PipelineShape,
    dims: ParallelDims,
    mesh: DeviceMesh,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    costs: list[float] | None = None,
) -> StagesOnMeta:
    """The model on meta, cut into stages, this rank's kept and laid out (the dry run stops here)."""
    with torch.device("meta"):
        model = factory()
    plan = plan_of(model)
    stages = cut_stages(model, pipeline, shape.num_stages, costs)
    mine = shape.stages_of_rank(mesh["pp"].get_local_rank())
    kept = {path for index in mine for path in stages[index]}
    keep_only(model, pipeline_sequence(model), kept)
    local_plan = replace(plan, blocks=tuple(block for block in plan.blocks if _inside(block, kept)))
    _apply_block_layouts(model, options, dims=dims, mesh=mesh, plan=local_plan)
    modules: list[nn.Module] = stage_modules(model, [stages[index] for index in mine], autocast)
    if options.strategy in ("fsdp", "hsdp"):
        fsdp_mesh = mesh["dp_shard"] if options.strategy == "fsdp" else mesh["dp_replicate", "dp_shard"]
        apply_fsdp(model, fsdp_mesh, plan=local_plan, options=options.fsdp, roots=modules)
    return StagesOnMeta(model, modules, mine, stages)


def _apply_block_layouts(
    model: nn.Module, options, *, dims: ParallelDims, mesh: DeviceMesh, plan: ParallelPlan
) -> None:
    if dims.tp > 1:
        check_tensor_parallel_plan(plan, dims.tp)
        apply_tensor_parallel(model, mesh["tp"], plan=plan, sequence_parallel=False)
    if options.activation_checkpointing:
        apply_activation_checkpointing(model, plan=plan)
    if options.compile:
        apply_compile(model, plan=plan)


def _ddp(module: StageModule, options, *, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """DDP around one stage. The pipeline runtime prepares DDP's reducer for the last micro-batch's
    backward itself; with DDP's default bucket rebuilding, the first step then records every
    parameter twice and the second step's forward fails an internal assert in reducer.cpp (torch
    2.13). find_unused_parameters=True turns bucket rebuilding off (and costs one graph walk per
    step). static_graph=True runs but averages gradients wrongly, so preflight refuses it."""
    ddp = options.ddp
    return apply_ddp(
        module,
        mesh,
        device=device,
        bucket_cap_mb=ddp.bucket_cap_mb,
        static_graph=False,
        find_unused_parameters=True,
        gradient_as_bucket_view=ddp.gradient_as_bucket_view,
    )


def _inside(path: str, kept: set[str]) -> bool:
    return any(path == piece or path.startswith(piece + ".") for piece in kept)


def measure_piece_costs(
    factory: Callable[[], nn.Module], sample: torch.Tensor, *, device: torch.device, seed: int
) -> list[float]:
    """pipeline.balance=time: each piece's forward + backward time on one micro-batch, measured on a
    whole copy of the model (so the measuring rank briefly holds all of it)."""
    with torch.device("meta"):
        model = factory()
    materialize(model, device=device, seed=seed)
    return measured_costs(model, pipeline_sequence(model), sample.to(device))
