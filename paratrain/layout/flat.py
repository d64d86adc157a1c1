"""The flat layouts (everything but a pipeline): the model built on meta, parallelized, materialised, and
run by micro-batch accumulation."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from paratrain.config.schema import ParallelConfig
from paratrain.engine import MicroBatchEngine
from paratrain.layout.request import LaidOutModel, LayoutRequest
from paratrain.models.contract import warn_misspelt_hooks
from paratrain.models.init import build_on_meta, initialises_piecewise, is_on_meta, materialize
from paratrain.models.plan_derivation import plan_of
from paratrain.parallel.dims import ParallelDims
from paratrain.parallel.model_parallel import apply_model_parallel
from paratrain.parallel.parallelize import maybe_wrap_replicas, parallelize
from paratrain.parallel.sequence_sharding import SequenceSharding

logger = logging.getLogger("paratrain")


def build_model(
    factory: Callable[[], nn.Module],
    dims: ParallelDims,
    *,
    options: ParallelConfig,
    device: torch.device,
    seed: int,
    pretrained: Path | None = None,
    sequence: SequenceSharding | None = None,
    resuming: bool = False,
    seed_checkpoint_dir: Path | None = None,
) -> LaidOutModel:
    """Builds the model on the meta device, parallelizes it, materialises it (``models.init`` says
    where the weights come from), then wraps replicas (DDP or DataParallel). The engine is left to the
    caller (None here).

    A plain model from scratch (no ``init_parameter``, not a transformers model) in an unsharded layout is
    instead built directly on its device, so whatever its constructor initialises stays as the user wrote
    it. A factory that returns real weights is laid out as it is.
    """
    model = build_on_meta(factory, seed=seed)
    from_scratch = pretrained is None and not resuming
    if is_on_meta(model) and from_scratch and not (dims.is_sharded or initialises_piecewise(model)):
        torch.manual_seed(seed)
        model = factory()
    if not (is_on_meta(model) or dims.is_sharded):
        model = model.to(device)
    parallelize(model, dims, plan=plan_of(model), options=options, sequence=sequence)
    offload = dims.fsdp_enabled and options.fsdp.cpu_offload
    materialize(
        model,
        factory=factory,
        device=torch.device("cpu") if offload else device,
        seed=seed,
        pretrained=pretrained,
        resuming=resuming,
        seed_checkpoint_dir=seed_checkpoint_dir,
    )
    runnable = maybe_wrap_replicas(model, dims, options=options, device=device)
    return LaidOutModel(model, runnable, engine=None)


def build_flat_layout(request: LayoutRequest) -> LaidOutModel:
    """The model and its micro-batch accumulation engine, for every layout without a pipeline."""
    dims, ctx, parallel = request.dims, request.ctx, request.parallel
    built = build_model(
        request.model_factory,
        dims,
        options=parallel,
        device=build_device(dims, ctx.device),
        seed=request.train.seed,
        pretrained=request.pretrained,
        sequence=request.sequence,
        resuming=request.resuming,
        seed_checkpoint_dir=request.seed_checkpoint_dir,
    )
    if ctx.is_main:
        warn_misspelt_hooks(built.bare)
    runnable, device = built.runnable, ctx.device
    if dims.model_parallel_enabled:
        runnable = apply_model_parallel(built.bare, request.pipeline)
        device = runnable.devices[-1]  # where the output, so the loss, is computed
    # FSDP's grad_sync policy; other layouts always sync on the last micro-batch only.
    every_micro_batch = dims.fsdp_enabled and parallel.fsdp.grad_sync == "every_micro_batch"
    engine = MicroBatchEngine(
        runnable,
        request.loss_fn,
        request.precision,
        device=device,
        sync_every_micro_batch=every_micro_batch,
        sequence=request.sequence,
        loss_group=dims.loss_mesh.get_group() if dims.mesh is not None and dims.loss_mesh is not None else None,
        loss_ranks=dims.loss_ranks,
    )
    return LaidOutModel(built.bare, runnable, engine, request.sequence)


def build_device(dims: ParallelDims, device: torch.device) -> torch.device:
    """Where the model is first materialised. model_parallel builds it in host memory and then moves each
    part to its own device, so a model that only fits split never lands whole on the first GPU."""
    return torch.device("cpu") if dims.model_parallel_enabled else device
