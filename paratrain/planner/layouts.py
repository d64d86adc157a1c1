"""The layouts a number of GPUs allows: every pp x dp_replicate x dp_shard x tp whose product is the GPU
count, under each strategy that can run it, with tensor parallel kept within a node; and context parallel
(cp) taking part of the data-parallel ranks under fsdp, for sequences whose activations do not fit.

Each candidate is checked by the same rules ``paratrain train`` applies before launching (degrees,
batch divisibility, the model's tensor-parallel plan, pipeline settings), so a layout the planner
ranks is one that would start.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from paratrain.checks.sequence_settings import check_sequence_layout
from paratrain.config.schema import DEGREES
from paratrain.errors import ConfigError
from paratrain.parallel.dims import ParallelDims, resolve_parallel_dims
from paratrain.planner.inputs import PlanInputs
from paratrain.planner.model_facts import ModelFacts


@dataclass(frozen=True)
class Cluster:
    """GPUs of equal memory, spread evenly over nodes of equal host memory."""

    gpus: int
    nodes: int
    gpu_memory: int  # bytes per GPU
    host_memory: int | None = None  # bytes of RAM per node; None: layouts are not judged by it

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes

    def check(self) -> None:
        if self.gpus < 1 or self.nodes < 1:
            raise ConfigError(f"--gpus={self.gpus} --nodes={self.nodes}: both must be at least 1")
        if self.gpus % self.nodes:
            raise ConfigError(
                f"--gpus={self.gpus} does not split evenly over --nodes={self.nodes}; "
                f"give a GPU count that is a multiple of the node count"
            )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(cluster: Cluster, *, num_experts: int = 0) -> Iterator[ParallelDims]:
    """Every strategy and degree combination for the cluster, tensor parallel within a node; those with
    context parallel after all the others (listed, and refused, after them). For a model with
    ``num_experts`` experts per block, each sharded layout is followed by itself with every expert-parallel
    degree that divides both dp_shard x cp and the experts."""
    splits = [
        (pp, tp, cluster.gpus // (pp * tp))
        for pp in divisors(cluster.gpus)
        for tp in divisors(cluster.gpus // pp)
        if cluster.gpus_per_node % tp == 0
    ]
    for pp, tp, dp in splits:
        for dims in _data_parallel_choices(pp, tp, dp):
            yield dims
            yield from _expert_parallel_choices(dims, num_experts)
    for pp, tp, dp in splits:
        for cp in divisors(dp)[1:]:  # sequences split over cp of the ranks, FSDP over dp_shard x cp
            dims = ParallelDims("fsdp", pp=pp, dp_shard=dp // cp, cp=cp, tp=tp)
            yield dims
            yield from _expert_parallel_choices(dims, num_experts)


def _expert_parallel_choices(dims: ParallelDims, num_experts: int) -> Iterator[ParallelDims]:
    if not num_experts or not dims.fsdp_enabled:
        return
    for ep in divisors(dims.dp_shard * dims.cp)[1:]:
        if num_experts % ep == 0:
            yield replace(dims, ep=ep)


def _data_parallel_choices(pp: int, tp: int, dp: int) -> Iterator[ParallelDims]:
    if dp == 1:
        if tp > 1:
            yield ParallelDims("tp", pp=pp, tp=tp)
        else:
            yield ParallelDims("pp" if pp > 1 else "single", pp=pp)
        return
    if tp == 1:
        yield ParallelDims("ddp", pp=pp, dp_replicate=dp)
    yield ParallelDims("fsdp", pp=pp, dp_shard=dp, tp=tp)
    for shard in divisors(dp)[1:-1]:
        yield ParallelDims("hsdp", pp=pp, dp_replicate=dp // shard, dp_shard=shard, tp=tp)


def layout_overrides(dims: ParallelDims) -> list[str]:
    """Config overrides that select this layout, every degree explicit (so the file's own degrees do not mix in)."""
    degrees = [f"parallel.{name}={getattr(dims, name)}" for name in DEGREES if name != "ep" or dims.ep_enabled]
    return [f"parallel.strategy={dims.strategy}", *degrees]


def describe_layout(dims: ParallelDims) -> str:
    """Short name: the strategy and the degrees above 1, e.g. ``fsdp dp_shard=8 tp=8``."""
    degrees = [f"{name}={getattr(dims, name)}" for name in DEGREES if getattr(dims, name) > 1]
    return " ".join([dims.strategy, *degrees])


def layout_problem(inputs: PlanInputs, facts: ModelFacts, dims: ParallelDims, *, gpus_per_node: int) -> str | None:
    """Why ``paratrain train`` would refuse this layout, or None when it would start."""
    try:
        check_layout(inputs.with_layout(dims), facts, world_size=dims.world_size, gpus_per_node=gpus_per_node)
    except ConfigError as error:
        return str(error)
    return None


def check_layout(inputs: PlanInputs, facts: ModelFacts, *, world_size: int, gpus_per_node: int) -> ParallelDims:
    """The checks preflight makes of a layout, without those about this machine (devices, output_dir).

    Returns:
        The layout resolved from the inputs' parallel section (degrees filled in).

    Raises:
        ConfigError: naming the key and the fix.
    """
    resolved = resolve_parallel_dims(inputs.parallel, world_size=world_size, local_world_size=gpus_per_node)
    train = inputs.train
    step_unit = train.micro_batch_size * resolved.dp
    if train.global_batch_size % step_unit:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} is not divisible by train.micro_batch_size="
            f"{train.micro_batch_size} x data-parallel size {resolved.dp}; use a multiple of {step_unit}"
        )
    if resolved.tp > 1:
        # lazy: pipeline and tensor-parallel checks load their torch modules only for layouts that use them
        from paratrain.parallel.tensor import check_tensor_parallel_plan  # loads DTensor: only when used

        check_tensor_parallel_plan(facts.plan, resolved.tp)
    if resolved.ep_enabled:
        # lazy: loads DTensor only for layouts that use it
        from paratrain.parallel.expert import check_expert_plan

        check_expert_plan(facts.model, facts.plan, ep=resolved.ep)
    if resolved.pp > 1:
        # lazy: pipeline and tensor-parallel checks load their torch modules only for layouts that use them
        from paratrain.checks.pipeline_settings import check_pipeline

        check_pipeline(inputs, resolved, model=facts.model)
    check_sequence_layout(inputs.parallel, inputs.data, resolved, model=facts.model)
    return resolved
