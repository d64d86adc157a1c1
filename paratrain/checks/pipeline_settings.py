"""Pipeline settings checked before any process starts: each error names the key and the fix."""

from __future__ import annotations

from typing import Protocol

import torch

from paratrain.config.factories import call_factory
from paratrain.config.schema import ModelConfig, ParallelConfig, PipelineConfig, TrainConfig
from paratrain.errors import ConfigError
from paratrain.models.meta import on_meta
from paratrain.parallel.dims import ParallelDims
from paratrain.parallel.pipeline.split import cut_stages


class PipelineSections(Protocol):
    """The sections the pipeline checks read: the root Config has them, and so has the planner's PlanInputs."""

    @property
    def model(self) -> ModelConfig: ...
    @property
    def train(self) -> TrainConfig: ...
    @property
    def parallel(self) -> ParallelConfig: ...
    @property
    def pipeline(self) -> PipelineConfig: ...
    @property
    def precision(self) -> str: ...


def check_pipeline(config: PipelineSections, dims: ParallelDims, *, model: torch.nn.Module | None = None) -> None:
    """Raises ConfigError for pipeline settings that cannot run (only when the layout has a pipeline).

    Args:
        model: The config's model already built on the meta device, to cut stages from (the planner checks
            dozens of layouts); None builds it.
    """
    if dims.model_parallel_enabled:
        _check_model_parallel(config)
    if dims.pp == 1:
        return
    # Lazy: torch.distributed.pipelining loads torch._dynamo, a second at start-up for every run.
    from paratrain.parallel.pipeline.assembly import pipeline_shape
    from paratrain.parallel.pipeline.schedules import check_shape

    _check_combinations(config, dims)
    _check_microbatches(config, dims)
    shape = pipeline_shape(config.pipeline, dims=dims, train=config.train)
    check_shape(shape)
    if model is None:
        with on_meta():
            model = call_factory(config.model, key="model")
    cut_stages(model, config.pipeline, shape.num_stages)


def _check_microbatches(config: PipelineSections, dims: ParallelDims) -> None:
    microbatches = config.pipeline.microbatches
    per_pipeline = config.train.global_batch_size // dims.dp
    if microbatches and (config.train.global_batch_size % dims.dp or per_pipeline % microbatches):
        raise ConfigError(
            f"train.global_batch_size={config.train.global_batch_size} over data-parallel size {dims.dp} does not "
            f"split into pipeline.microbatches={microbatches} equal micro-batches; use a global batch that is a "
            f"multiple of {dims.dp * microbatches}, or a micro-batch count that divides {per_pipeline}"
        )


def _check_combinations(config: PipelineSections, dims: ParallelDims) -> None:
    options = config.parallel
    if config.precision == "fp16":
        raise ConfigError(
            "precision=fp16 with pipeline parallel is not supported: the schedule computes the loss and "
            "runs backward itself, so the gradient scaler cannot scale it; use precision=bf16 or fp32"
        )
    if dims.ddp_enabled and options.ddp.static_graph:
        raise ConfigError(
            "parallel.ddp.static_graph=true with parallel.pp gives wrong gradients (the pipeline runtime "
            "drives DDP's reducer itself); set parallel.ddp.static_graph=false"
        )
    if options.sequence_parallel:
        raise ConfigError(
            "parallel.sequence_parallel with parallel.pp is not supported yet; set "
            "parallel.sequence_parallel=false (tensor parallel itself works with pp)"
        )


def _check_model_parallel(config: PipelineSections) -> None:
    # lazy: model_parallel loads torch.distributed.pipelining (torch._dynamo, ~1 s) only for pipelines
    from paratrain.parallel.model_parallel import model_parallel_devices, part_count

    devices = model_parallel_devices(config.pipeline)
    options = config.pipeline
    if options.devices and options.split_points and len(options.split_points) != len(options.devices) - 1:
        raise ConfigError(
            f"pipeline.split_points names {len(options.split_points)} part end(s) but pipeline.devices "
            f"lists {len(options.devices)} devices; name one split point fewer than the devices"
        )
    with on_meta():
        model = call_factory(config.model, key="model")
    cut_stages(model, options, part_count(options, devices))
