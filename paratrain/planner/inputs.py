"""What the planner reads of a config: ``PlanInputs``, built once by ``plan_inputs`` at the planner's entry
points (``plan_layouts``, ``dry_run``, the memory check and ``parallel.strategy: auto``), so nothing below
them sees the root config."""

from __future__ import annotations

from dataclasses import dataclass, replace

from paratrain.config.schema import (
    DEGREES,
    CheckpointConfig,
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PipelineConfig,
    TrainConfig,
)
from paratrain.parallel.dims import ParallelDims


@dataclass(frozen=True)
class PlanInputs:
    """The sections the planner reads; the fields it reads of each are listed.

    Sections are kept whole where the planner hands them to the functions training itself uses
    (``call_factory``, ``pipeline_shape``, ``micro_batch_size``, ``cut_stages``, ``parallelize``), so the
    plan is computed by the same rules as the run.

    Attributes:
        model: ``factory`` and ``args``: the model built on the meta device; the factory is named in reports.
            ``pretrained``: whether each rank reads its shard from files (host_memory.py).
        data: ``factory`` and ``args``: one sample, to measure the activations of a model that is not GPT-like.
        seq_len: ``data.args.block_size`` (or ``seq_len``, as chat data calls it): the sequence length, when
            the data names one.
        train: ``global_batch_size`` and ``micro_batch_size``.
        optim: ``name`` and ``momentum``: the size of the optimizer state.
        parallel: ``strategy`` and degrees (replaced by each candidate layout), ``sequence_parallel``,
            ``activation_checkpointing``, ``fsdp`` (``param_dtype``, ``reduce_dtype``, ``grad_sync``,
            ``reshard_after_forward``) and ``ddp.gradient_as_bucket_view``.
        pipeline: ``schedule``, ``microbatches`` and how stages are cut.
        precision: The compute dtype: activations' bytes per element.
        checkpoint: ``resume`` and ``async_save``: what a process holds in host memory (host_memory.py).
    """

    model: ModelConfig
    data: DataConfig
    seq_len: int | None
    train: TrainConfig
    optim: OptimConfig
    parallel: ParallelConfig
    pipeline: PipelineConfig
    precision: str
    checkpoint: CheckpointConfig

    def with_layout(self, dims: ParallelDims) -> PlanInputs:
        """These inputs with the parallel strategy and degrees replaced by this layout's."""
        return replace(self, parallel=parallel_with_layout(self.parallel, dims))


def plan_inputs(config: Config) -> PlanInputs:
    """The planner's inputs, read off the root config."""
    return PlanInputs(
        model=config.model,
        data=config.data,
        seq_len=config.data.args.get("block_size") or config.data.args.get("seq_len"),
        train=config.train,
        optim=config.optim,
        parallel=config.parallel,
        pipeline=config.pipeline,
        precision=config.precision,
        checkpoint=config.checkpoint,
    )


def parallel_with_layout(parallel: ParallelConfig, dims: ParallelDims) -> ParallelConfig:
    """The parallel section with its strategy and every degree replaced by this layout's."""
    degrees = {name: getattr(dims, name) for name in DEGREES}
    return parallel.model_copy(update={"strategy": dims.strategy, **degrees})
