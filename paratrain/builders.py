"""Building a rank's model under its layout: the flat layouts here, the pipeline through
``parallel.pipeline.runtime``. Both lay the model out with ``parallel.parallelize``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from paratrain.config.schema import ParallelConfig, PipelineConfig, TrainConfig
from paratrain.engine import LaidOutModel, LossFn, MicroBatchEngine
from paratrain.launch.process_group import DistContext
from paratrain.models.init import declares_init, materialize
from paratrain.models.plan import plan_of
from paratrain.parallel.dims import ParallelDims
from paratrain.parallel.model_parallel import apply_model_parallel
from paratrain.parallel.parallelize import maybe_wrap_replicas, parallelize
from paratrain.precision import MixedPrecision

logger = logging.getLogger("paratrain")


def build_model(
    factory: Callable[[], nn.Module],
    dims: ParallelDims,
    *,
    options: ParallelConfig,
    device: torch.device,
    seed: int,
) -> LaidOutModel:
    """Builds the model on the meta device, parallelizes it, materialises it, then wraps replicas
    (DDP or DataParallel). The engine is left to the caller (None here).

    A model without ``init_parameter`` in an unsharded layout is instead built directly on its
    device, so whatever its constructor initialises stays as the user wrote it.
    """
    with torch.device("meta"):
        model = factory()
    if not (dims.is_sharded or declares_init(model)):
        torch.manual_seed(seed)
        model = factory().to(device)
    parallelize(model, dims, plan=plan_of(model), options=options)
    if _is_on_meta(model):
        offload = dims.fsdp_enabled and options.fsdp.cpu_offload
        materialize(model, device=torch.device("cpu") if offload else device, seed=seed)
    runnable = maybe_wrap_replicas(model, dims, options=options, device=device)
    return LaidOutModel(model, runnable, engine=None)


def build_layout(
    model_factory: Callable[[], nn.Module],
    loss_fn: LossFn,
    *,
    dims: ParallelDims,
    ctx: DistContext,
    precision: MixedPrecision,
    parallel: ParallelConfig,
    pipeline: PipelineConfig,
    train: TrainConfig,
    sample_dataset: Dataset,
    timeline_dir: Path,
) -> LaidOutModel:
    """The model and engine of the layout: a pipeline schedule for pp, micro-batch accumulation otherwise.

    Args:
        sample_dataset: Where pipeline.balance=time reads a micro-batch to time the model's pieces on.
        timeline_dir: Where pipeline.record_timeline writes each rank's timeline.
    """
    if dims.pp_enabled:
        # Deliberately lazy: torch.distributed.pipelining loads torch._dynamo, a second at start-up
        # that layouts without a pipeline would pay for nothing.
        from paratrain.parallel.pipeline.runtime import build_pipeline_runtime

        return build_pipeline_runtime(
            model_factory,
            loss_fn,
            dims=dims,
            ctx=ctx,
            autocast=precision.autocast,
            parallel=parallel,
            pipeline=pipeline,
            train=train,
            sample_dataset=sample_dataset,
            timeline_dir=timeline_dir,
        )
    built = build_model(model_factory, dims, options=parallel, device=ctx.device, seed=train.seed)
    runnable, device = built.runnable, ctx.device
    if dims.model_parallel_enabled:
        runnable = apply_model_parallel(built.bare, pipeline)
        device = runnable.devices[-1]  # where the output, so the loss, is computed
    # FSDP's grad_sync policy; other layouts always sync on the last micro-batch only.
    every_micro_batch = dims.fsdp_enabled and parallel.fsdp.grad_sync == "every_micro_batch"
    engine = MicroBatchEngine(runnable, loss_fn, precision, device=device, sync_every_micro_batch=every_micro_batch)
    return LaidOutModel(built.bare, runnable, engine)


def _is_on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def tokens_per_sample(dataset: Dataset) -> int | None:
    """Token count of one sample when its inputs are token ids (integer tensors), else None."""
    inputs = dataset[0][0]
    is_tokens = isinstance(inputs, torch.Tensor) and not inputs.is_floating_point()
    return inputs.numel() if is_tokens else None
