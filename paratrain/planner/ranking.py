"""Estimates for every candidate layout, which of them fit, and the one to recommend.

A layout fits when its fullest rank needs at most ``USABLE_FRACTION`` of a GPU's memory (the rest is
headroom for the CUDA context, the allocator's fragmentation and temporary buffers the estimate
leaves out) and, when the cluster names its host memory, its fullest node's processes fit in that
(host_memory.py). Layouts that fit are ranked by their estimated overhead per step, then by memory:

    overhead = communication time (not overlapped, at the nominal link speeds of communication.py)
             + pipeline bubble (p-1)/(v·m + p-1) x compute time
             + repeated work: (tp-1) x the experts' share of compute time (a mixture of experts stays
               whole on every tensor-parallel rank, which all compute it for the same tokens)
    compute time = 6 x Ψ x tokens per step / (GPUs x NOMINAL_FLOPS)

(6Ψ FLOPs per token for forward and backward; samples instead of tokens for models that are not
GPT-like). Only the comparison between layouts matters: the same compute time is in every one.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.parallel.dims import ParallelDims
from paratrain.planner.accounting import RankMemory, rank_memory, stage_shares
from paratrain.planner.communication import Traffic, step_traffic
from paratrain.planner.host_memory import DeviceKind, NodeHostMemory, node_host_memory
from paratrain.planner.inputs import PlanInputs
from paratrain.planner.layouts import Cluster, candidate_layouts, describe_layout, layout_problem
from paratrain.planner.model_facts import ModelFacts
from paratrain.planner.units import format_seconds

USABLE_FRACTION = 0.9
NOMINAL_FLOPS = 400e12  # achieved FLOP/s per GPU: about 40 % of an H100's dense bf16 peak (docs/planner.md)


@dataclass(frozen=True)
class LayoutEstimate:
    """One layout: the memory of its fullest rank, each pipeline rank's, its fullest node's host memory, and
    its traffic per step."""

    dims: ParallelDims
    per_pp_rank: tuple[RankMemory, ...]
    traffic: Traffic  # of the pipeline rank that sends most
    bubble_seconds: float  # pipeline idle time per step (0 without a pipeline)
    host: NodeHostMemory
    repeated_seconds: float = 0.0  # expert compute repeated on every tp rank (0 without experts or tp)

    @property
    def overhead_seconds(self) -> float:
        return self.traffic.seconds + self.bubble_seconds + self.repeated_seconds

    @property
    def peak(self) -> RankMemory:
        return max(self.per_pp_rank, key=lambda memory: memory.total)

    def fits_gpu(self, gpu_memory: int) -> bool:
        return self.peak.total <= USABLE_FRACTION * gpu_memory

    def fits(self, cluster: Cluster) -> bool:
        return self.fits_gpu(cluster.gpu_memory) and self.host.fits(cluster.host_memory)

    def sort_key(self, cluster: Cluster) -> tuple:
        return (not self.fits(cluster), self.overhead_seconds, self.peak.total)


@dataclass(frozen=True)
class Plan:
    """Every layout the cluster allows, ranked; and those ``paratrain train`` would refuse, with why."""

    cluster: Cluster
    ranked: tuple[LayoutEstimate, ...]
    refused: tuple[tuple[ParallelDims, str], ...]

    @property
    def fitting(self) -> tuple[LayoutEstimate, ...]:
        return tuple(estimate for estimate in self.ranked if estimate.fits(self.cluster))

    @property
    def recommended(self) -> LayoutEstimate | None:
        return self.fitting[0] if self.fitting else None


def estimate_layout(
    facts: ModelFacts,
    inputs: PlanInputs,
    dims: ParallelDims,
    *,
    gpus_per_node: int,
    measured_per_sample: float | None,
    device: DeviceKind = "cuda",
) -> LayoutEstimate:
    """Memory and traffic of one layout (the inputs' parallel section is replaced by it).

    Args:
        gpus_per_node: Processes per node (on CPU runs too): what shares a node's links and host memory.
        device: Whether the processes train on GPUs or on the CPU, for their host memory.
    """
    inputs = inputs.with_layout(dims)
    shares = stage_shares(facts, inputs, dims)
    memory = tuple(rank_memory(facts, share, inputs, dims, measured_per_sample=measured_per_sample) for share in shares)
    traffic = max(
        (step_traffic(facts, share, inputs, dims, gpus_per_node=gpus_per_node) for share in shares),
        key=lambda sent: sent.seconds,
    )
    compute = compute_seconds(facts, inputs, dims)
    repeated = (dims.tp - 1) * compute * facts.expert_params / facts.num_params if facts.num_params else 0.0
    fullest = max(memory, key=lambda rank: rank.total)
    host = node_host_memory(facts, inputs, fullest, dims, device=device, processes=gpus_per_node)
    return LayoutEstimate(dims, memory, traffic, bubble_fraction(inputs, dims) * compute, host, repeated)


def compute_seconds(facts: ModelFacts, inputs: PlanInputs, dims: ParallelDims) -> float:
    """Forward and backward time of one step on each GPU at NOMINAL_FLOPS (6Ψ FLOPs per token, or per sample)."""
    per_sample = facts.transformer.seq_len if facts.transformer else 1
    work = 6.0 * facts.num_params * inputs.train.global_batch_size * per_sample
    return work / (dims.world_size * NOMINAL_FLOPS)


def bubble_fraction(inputs: PlanInputs, dims: ParallelDims) -> float:
    """Idle share of a pipeline step: (p-1)/(v·m + p-1), the GPipe/1F1B/interleaved formula of docs/pipeline.md."""
    if dims.pp == 1:
        return 0.0
    # lazy: pipeline building loads torch.distributed.pipelining (torch._dynamo) only for pp layouts
    from paratrain.parallel.pipeline.assembly import pipeline_shape  # loads torch.distributed.pipelining: pp only

    shape = pipeline_shape(inputs.pipeline, dims=dims, train=inputs.train)
    return (dims.pp - 1) / (shape.stages_per_rank * shape.microbatches + dims.pp - 1)


def rank_layouts(facts: ModelFacts, inputs: PlanInputs, cluster: Cluster, *, measured_per_sample: float | None) -> Plan:
    """Estimates every runnable candidate layout and ranks them (see the module docstring)."""
    cluster.check()
    estimates, refused = [], []
    for dims in candidate_layouts(cluster, num_experts=max(facts.plan.num_experts.values(), default=0)):
        problem = layout_problem(inputs, facts, dims, gpus_per_node=cluster.gpus_per_node)
        if problem:
            refused.append((dims, problem))
            continue
        estimates.append(
            estimate_layout(
                facts, inputs, dims, gpus_per_node=cluster.gpus_per_node, measured_per_sample=measured_per_sample
            )
        )
    estimates.sort(key=lambda estimate: estimate.sort_key(cluster))
    return Plan(cluster, tuple(estimates), tuple(refused))


def recommendation_reason(plan: Plan) -> str:
    """Why the first layout that fits is the one to use, in a sentence or two."""
    best = plan.recommended
    if best is None:
        return "no layout fits"
    gpu = plan.cluster.gpu_memory
    reason = (
        f"its fullest rank needs {best.peak.total / gpu:.0%} of a GPU's memory (at most {USABLE_FRACTION:.0%} "
        f"counts as fitting), and of the {len(plan.fitting)} layout(s) that fit it has the least estimated "
        f"overhead per step: {format_seconds(best.traffic.seconds)} of communication"
    )
    if best.dims.pp > 1:
        reason += f" + {format_seconds(best.bubble_seconds)} of pipeline bubble"
    if best.repeated_seconds:
        reason += f" + {format_seconds(best.repeated_seconds)} of expert compute repeated on its tp ranks"
    others = [estimate for estimate in plan.fitting[1:] if estimate.traffic.seconds < best.traffic.seconds]
    if others:
        reason += (
            f"; {describe_layout(others[0].dims)} sends less but idles {format_seconds(others[0].bubble_seconds)} "
            f"in its pipeline bubble"
        )
    return reason
