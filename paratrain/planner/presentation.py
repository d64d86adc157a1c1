"""The planner's printed report: a header, a table of the layouts ranked, and the recommendation."""

from __future__ import annotations

from paratrain.checks.objectives import PREFERENCE_DATA
from paratrain.config.schema import ParallelConfig
from paratrain.parallel.dims import ParallelDims
from paratrain.planner.host_memory import HostMemory, NodeHostMemory
from paratrain.planner.inputs import PlanInputs
from paratrain.planner.layouts import Cluster, describe_layout, layout_overrides
from paratrain.planner.model_facts import ModelFacts
from paratrain.planner.ranking import USABLE_FRACTION, LayoutEstimate, Plan, recommendation_reason
from paratrain.planner.units import format_bytes, format_seconds

SHOWN_LAYOUTS = 12


def format_plan(
    plan: Plan, facts: ModelFacts, inputs: PlanInputs, *, config_path: str, activation_source: str, host_source: str
) -> str:
    lines = [
        *_header(plan, facts, inputs, activation_source, host_source),
        "",
        *_table(plan),
        *_refused(plan),
        "",
        *_verdict(plan, config_path, checkpointing=inputs.parallel.activation_checkpointing != "none"),
    ]
    return "\n".join(lines)


def _refused(plan: Plan, shown: int = 3) -> list[str]:
    """A few layouts paratrain train would refuse, with the first line of its reason."""
    lines = [
        f"  refused: {describe_layout(dims)}: {_shorten(reason.splitlines()[0])}"
        for dims, reason in plan.refused[:shown]
    ]
    if len(plan.refused) > shown:
        lines.append(f"  refused: ... {len(plan.refused) - shown} more")
    return lines


def _checkpointing(parallel: ParallelConfig) -> str:
    """How the header says it: off, full, selective, or e.g. "selective on every 2nd block"."""
    mode, every = parallel.activation_checkpointing, parallel.activation_checkpointing_every
    if mode == "none":
        return "off"
    return mode if every == 1 else f"{mode} on every {every}{_ordinal_suffix(every)} block"


def _float8(parallel: ParallelConfig) -> str:
    return f", float8 {parallel.float8.scaling} matmuls in the blocks" if parallel.float8.enabled else ""


def _ordinal_suffix(number: int) -> str:
    return "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")


def _header(plan: Plan, facts: ModelFacts, inputs: PlanInputs, activation_source: str, host_source: str) -> list[str]:
    cluster = plan.cluster
    optimizer = inputs.optim.name + (f" (momentum {inputs.optim.momentum})" if inputs.optim.name == "sgd" else "")
    return [
        f"model: {inputs.model.factory}, {facts.num_params:,} parameters ({len(facts.params)} tensors); "
        f"optimizer {optimizer}; precision {inputs.precision}{_float8(inputs.parallel)} (weights, gradients, "
        f"optimizer state fp32)",
        f"batch: global {inputs.train.global_batch_size}, micro {inputs.train.micro_batch_size}; activation "
        f"checkpointing {_checkpointing(inputs.parallel)}; activations: {activation_source}",
        *_fine_tuning_lines(facts, inputs),
        _cluster_line(cluster, host_source),
        f"{len(plan.ranked)} layout(s) estimated, {len(plan.fitting)} fit; {len(plan.refused)} refused by "
        f"paratrain's checks",
    ]


def _fine_tuning_lines(facts: ModelFacts, inputs: PlanInputs) -> list[str]:
    """What LoRA saves (frozen weights hold no gradient and no optimizer state) and what DPO's reference costs."""
    lines = []
    frozen = sum(param.numel for param in facts.params if not param.trainable)
    if frozen:
        trained = facts.num_params - frozen
        saved = frozen * (4 + 8)  # fp32 gradients and AdamW's two moments (the table counts them so)
        lines.append(
            f"LoRA: {trained:,} of {facts.num_params:,} parameters train ({100 * trained / facts.num_params:.2f} %): "
            f"{format_bytes(saved)} of gradients and optimizer state a full fine-tune would hold, divided by the "
            f"shards under fsdp, are not held"
        )
    if inputs.data.factory == PREFERENCE_DATA:
        lines.append(
            "DPO: the reference is the model as it starts, its log-probabilities of each pair computed once before "
            "training (2 numbers per pair, in every checkpoint): no second copy of the model, one forward pass"
        )
    return lines


def _cluster_line(cluster: Cluster, host_source: str) -> str:
    usable = format_bytes(USABLE_FRACTION * cluster.gpu_memory)
    line = (
        f"cluster: {cluster.gpus} GPU(s) on {cluster.nodes} node(s), {format_bytes(cluster.gpu_memory)} each "
        f"({USABLE_FRACTION:.0%} usable: {usable})"
    )
    if cluster.host_memory is None:
        return line
    return f"{line}; host memory {format_bytes(cluster.host_memory)} per node ({host_source})"


def _table(plan: Plan) -> list[str]:
    header = (
        f"{'#':>3}  {'layout':<38} {'params':>10} {'grads':>10} {'optim':>10} {'activ.':>10} {'working':>10} "
        f"{'total':>10} {'of GPU':>6} {'host/node':>10}  {'comm/step':>10} {'x-node':>10} {'overhead':>9}  fits"
    )
    rows = [header]
    for index, estimate in enumerate(plan.ranked[:SHOWN_LAYOUTS], start=1):
        rows.append(_row(index, estimate, plan.cluster))
    if len(plan.ranked) > SHOWN_LAYOUTS:
        rows.append(f"  ... {len(plan.ranked) - SHOWN_LAYOUTS} more")
    return rows


def _row(index: int, estimate: LayoutEstimate, cluster: Cluster) -> str:
    peak, traffic = estimate.peak, estimate.traffic
    cells = [
        format_bytes(value)
        for value in (peak.params, peak.grads, peak.optimizer, peak.activations, peak.working, peak.total)
    ]
    return (
        f"{index:>3}  {describe_layout(estimate.dims):<38} "
        + " ".join(f"{cell:>10}" for cell in cells)
        + f" {peak.total / cluster.gpu_memory:>6.0%} {format_bytes(estimate.host.per_node):>10}"
        + f"  {format_bytes(traffic.total):>10} {format_bytes(traffic.inter_node):>10}"
        + f" {format_seconds(estimate.overhead_seconds):>9}"
        + f"  {_fits_cell(estimate, cluster)}"
    )


def _fits_cell(estimate: LayoutEstimate, cluster: Cluster) -> str:
    if not estimate.fits_gpu(cluster.gpu_memory):
        return "no"
    return "yes" if estimate.fits(cluster) else "no: host"


def _shorten(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_command(config_path: str, cluster: Cluster, dims: ParallelDims) -> str:
    """The ``paratrain train`` command line that runs this layout on the cluster."""
    return (
        f"paratrain train {config_path} --nproc-per-node {cluster.gpus_per_node} --nnodes {cluster.nodes} "
        + " ".join(layout_overrides(dims))
    )


def _verdict(plan: Plan, config_path: str, *, checkpointing: bool) -> list[str]:
    best, cluster = plan.recommended, plan.cluster
    if best is None and not plan.ranked:
        return [f"no layout of {cluster.gpus} GPU(s) passes paratrain's checks (the refusals above say why)."]
    if best is None:
        return _nothing_fits(plan, checkpointing=checkpointing)
    command = run_command(config_path, cluster, best.dims)
    degrees = best.dims.describe()
    return [
        f"recommended: {describe_layout(best.dims)} ({degrees}), {format_bytes(best.peak.total)} per rank",
        f"why: {recommendation_reason(plan)}.",
        host_verdict(best, cluster),
        f"run it: {command}",
    ]


def _nothing_fits(plan: Plan, *, checkpointing: bool) -> list[str]:
    """Why no layout fits: the GPUs' memory (the least-memory layout named), or only the nodes' host memory."""
    cluster, usable = plan.cluster, format_bytes(USABLE_FRACTION * plan.cluster.gpu_memory)
    on_gpus = [estimate for estimate in plan.ranked if estimate.fits_gpu(cluster.gpu_memory)]
    if on_gpus:
        least = min(on_gpus, key=lambda estimate: estimate.host.per_node)
        return [
            f"no layout fits: {len(on_gpus)} fit in {usable} per GPU, but none in "
            f"{format_bytes(cluster.host_memory)} of host memory per node. Pass --host-memory with the nodes' "
            f"RAM if they have more, or spread the GPUs over more nodes (--nodes).",
            host_verdict(least, cluster),
        ]
    smallest = min(plan.ranked, key=lambda estimate: estimate.peak.total)
    tries = "" if checkpointing else "parallel.activation_checkpointing=selective (or full), "
    return [
        f"no layout fits in {usable} per GPU; the least memory is {describe_layout(smallest.dims)} at "
        f"{format_bytes(smallest.peak.total)} per rank. Try {tries}a smaller train.micro_batch_size, or more GPUs.",
        host_verdict(smallest, cluster),
    ]


def host_verdict(estimate: LayoutEstimate, cluster: Cluster) -> str:
    """The host memory a node of this layout needs, against the cluster's, with what each process holds."""
    node = estimate.host
    if cluster.host_memory is None:
        against = "(not judged)"
    else:
        verdict = "fits" if node.fits(cluster.host_memory) else "does not fit"
        against = f"of {format_bytes(cluster.host_memory)}: {verdict}"
    return (
        f"host memory of {describe_layout(estimate.dims)}: {format_bytes(node.per_node)} per node {against}; "
        f"{describe_node_host(node)}"
    )


def describe_node_host(node: NodeHostMemory) -> str:
    """What the node's processes hold: ``8 GPU process(es) x 38.77 GiB = runtime 2.00 GiB + init 36.77 GiB
    (its other phases: ...)``, rank 0 apart when it builds the whole model."""
    kind = "GPU" if node.device == "cuda" else "CPU"
    if node.first == node.other:
        return f"{node.processes} {kind} process(es) x {_describe_process(node.other)}"
    return (
        f"rank 0 {_describe_process(node.first)}, building the whole model once (it has no init_parameter hook); "
        f"{node.processes - 1} other {kind} process(es) x {_describe_process(node.other)}"
    )


def _describe_process(host: HostMemory) -> str:
    phase = host.fullest_phase
    others = ", ".join(f"{name} {format_bytes(size)}" for name, size in host.phases.items() if name != phase)
    return (
        f"{format_bytes(host.total)} = runtime {format_bytes(host.runtime)} + {phase} "
        f"{format_bytes(host.phases[phase])} (its other phases: {others})"
    )
