"""Small ``build_*`` helpers the Trainer calls in order, each from its own config section."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import Dataset

from paratrain.config.schema import Config, ParallelConfig, PipelineConfig, TrainConfig
from paratrain.data.sampler import GlobalBatchSampler
from paratrain.engine import Engine, LossFn, MicroBatchEngine
from paratrain.launch.process_group import DistContext
from paratrain.models.init import declares_init, materialize
from paratrain.models.plan import plan_of
from paratrain.parallel.activation import apply_activation_checkpointing, apply_compile
from paratrain.parallel.data_parallel import apply_data_parallel
from paratrain.parallel.ddp import apply_ddp
from paratrain.parallel.dims import ParallelDims
from paratrain.parallel.fsdp import apply_fsdp
from paratrain.parallel.model_parallel import apply_model_parallel
from paratrain.parallel.tensor import apply_tensor_parallel, check_tensor_parallel_plan
from paratrain.precision import MixedPrecision

logger = logging.getLogger("paratrain")


@dataclass(frozen=True)
class BuiltModel:
    """The model as its parameters are named (``bare``) and as forward runs through (``runnable``:
    the same module for fsdp/tp, a DDP or DataParallel wrapper otherwise)."""

    bare: nn.Module
    runnable: nn.Module


def build_model(
    factory: Callable[[], nn.Module],
    options: ParallelConfig,
    *,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    device: torch.device,
    seed: int,
) -> BuiltModel:
    """Builds the model on the meta device and applies the layout in one fixed order: tensor
    parallel, activation checkpointing, compile, FSDP; then materialises; then DDP or DataParallel.

    A model without ``init_parameter`` in an unsharded layout is instead built directly on its
    device, so whatever its constructor initialises stays as the user wrote it.
    """
    sharded = dims.is_sharded
    with torch.device("meta"):
        model = factory()
    if not (sharded or declares_init(model)):
        torch.manual_seed(seed)
        model = factory().to(device)
    lay_out_model(model, options, dims=dims, mesh=mesh)
    if _is_on_meta(model):
        offload = options.strategy in ("fsdp", "hsdp") and options.fsdp.cpu_offload
        materialize(model, device=torch.device("cpu") if offload else device, seed=seed)
    return BuiltModel(model, _wrap_replicas(model, options, mesh=mesh, device=device))


@dataclass(frozen=True)
class Layout:
    """A rank's model under its layout, and the engine that runs a step's forwards and backwards."""

    bare: nn.Module  # parameters under the model's own names: what the optimizer and checkpoints see
    runnable: nn.Module  # what forward runs through
    engine: Engine


def build_layout(
    model_factory: Callable[[], nn.Module],
    loss_fn: LossFn,
    *,
    parallel: ParallelConfig,
    pipeline: PipelineConfig,
    train: TrainConfig,
    output_dir: Path,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    ctx: DistContext,
    dp_rank: int,
    dataset: Dataset,
    precision: MixedPrecision,
) -> Layout:
    """The model and engine of the layout: a pipeline schedule for pp, micro-batch accumulation otherwise."""
    if dims.pp > 1:
        from paratrain.parallel.pipeline.runtime import build_pipeline_runtime  # loads torch._dynamo: only when used

        runtime = build_pipeline_runtime(
            model_factory,
            loss_fn,
            parallel=parallel,
            pipeline=pipeline,
            train=train,
            output_dir=output_dir,
            dims=dims,
            mesh=mesh,
            device=ctx.device,
            rank=ctx.rank,
            dp_rank=dp_rank,
            dataset=dataset,
            autocast=precision.autocast,
        )
        return Layout(runtime.bare, nn.ModuleList(runtime.stage_modules), runtime.engine)
    built = build_model(model_factory, parallel, dims=dims, mesh=mesh, device=ctx.device, seed=train.seed)
    runnable, device = built.runnable, ctx.device
    if parallel.strategy == "model_parallel":
        runnable = apply_model_parallel(built.bare, pipeline)
        device = runnable.devices[-1]  # where the output, so the loss, is computed
    engine = MicroBatchEngine(
        runnable, loss_fn, precision, device=device, sync_every_micro_batch=_syncs_every_micro_batch(parallel)
    )
    return Layout(built.bare, runnable, engine)


def _syncs_every_micro_batch(options: ParallelConfig) -> bool:
    """FSDP's grad_sync policy; other layouts always sync on the last micro-batch only."""
    return options.strategy in ("fsdp", "hsdp") and options.fsdp.grad_sync == "every_micro_batch"


def lay_out_model(model: nn.Module, options: ParallelConfig, *, dims: ParallelDims, mesh: DeviceMesh | None) -> None:
    """Tensor parallel, activation checkpointing, compile and FSDP, in that order, on a model that may
    still be on meta (the dry run stops here); replicas are wrapped after materialising."""
    plan = plan_of(model)
    if dims.tp > 1:
        check_tensor_parallel_plan(plan, dims.tp)
        apply_tensor_parallel(model, mesh["tp"], plan=plan, sequence_parallel=options.sequence_parallel)
    if options.activation_checkpointing:
        apply_activation_checkpointing(model, plan=plan)
    if options.compile:
        apply_compile(model, plan=plan)
    if options.strategy in ("fsdp", "hsdp"):
        fsdp_mesh = mesh["dp_shard"] if options.strategy == "fsdp" else mesh["dp_replicate", "dp_shard"]
        apply_fsdp(model, fsdp_mesh, plan=plan, options=options.fsdp)
    elif options.strategy == "tp" and not dims.is_sharded:
        logger.warning("parallel.strategy=tp with parallel.tp=1 shards nothing")


def _wrap_replicas(
    model: nn.Module, options: ParallelConfig, *, mesh: DeviceMesh | None, device: torch.device
) -> nn.Module:
    if options.strategy == "ddp":
        ddp = options.ddp
        return apply_ddp(
            model,
            mesh,
            device=device,
            bucket_cap_mb=ddp.bucket_cap_mb,
            static_graph=ddp.static_graph,
            find_unused_parameters=ddp.find_unused_parameters,
            gradient_as_bucket_view=ddp.gradient_as_bucket_view,
        )
    if options.strategy == "dp":
        return apply_data_parallel(model, device=device)
    return model


def _is_on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def micro_batch_size(train: TrainConfig, pipeline: PipelineConfig, *, dims: ParallelDims) -> int:
    """Samples per forward on one rank: train.micro_batch_size, unless a pipeline's micro-batch
    count (pipeline.microbatches) decides it."""
    if dims.pp > 1 and pipeline.microbatches:
        return train.global_batch_size // (dims.dp * pipeline.microbatches)
    return train.micro_batch_size


def build_sampler(
    dataset_size: int, config: Config, *, dp_rank: int, dp_size: int, micro_batch_size: int
) -> GlobalBatchSampler:
    return GlobalBatchSampler(
        dataset_size=dataset_size,
        global_batch_size=config.train.global_batch_size,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=config.train.seed,
        shuffle=config.data.shuffle,
    )


def tokens_per_sample(dataset: Dataset) -> int | None:
    """Token count of one sample when its inputs are token ids (integer tensors), else None."""
    inputs = dataset[0][0]
    is_tokens = isinstance(inputs, torch.Tensor) and not inputs.is_floating_point()
    return inputs.numel() if is_tokens else None
