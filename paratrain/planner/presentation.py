"""The planner's printed report: a header, a table of the layouts ranked, and the recommendation."""

from __future__ import annotations

from paratrain.config.schema import ParallelConfig
from paratrain.parallel.dims import ParallelDims
from paratrain.planner.inputs import PlanInputs
from paratrain.planner.layouts import Cluster, describe_layout, layout_overrides
from paratrain.planner.model_facts import ModelFacts
from paratrain.planner.ranking import USABLE_FRACTION, LayoutEstimate, Plan, recommendation_reason
from paratrain.planner.units import format_bytes, format_seconds

SHOWN_LAYOUTS = 12


def format_plan(plan: Plan, facts: ModelFacts, inputs: PlanInputs, *, config_path: str, activation_source: str) -> str:
    lines = [
        *_header(plan, facts, inputs, activation_source),
        "",
        *_table(plan),
        *_refused(plan),
        "",
        *_verdict(plan, config_path),
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


def _header(plan: Plan, facts: ModelFacts, inputs: PlanInputs, activation_source: str) -> list[str]:
    cluster = plan.cluster
    optimizer = inputs.optim.name + (f" (momentum {inputs.optim.momentum})" if inputs.optim.name == "sgd" else "")
    return [
        f"model: {inputs.model.factory}, {facts.num_params:,} parameters ({len(facts.params)} tensors); "
        f"optimizer {optimizer}; precision {inputs.precision}{_float8(inputs.parallel)} (weights, gradients, "
        f"optimizer state fp32)",
        f"batch: global {inputs.train.global_batch_size}, micro {inputs.train.micro_batch_size}; activation "
        f"checkpointing {_checkpointing(inputs.parallel)}; activations: {activation_source}",
        f"cluster: {cluster.gpus} GPU(s) on {cluster.nodes} node(s), {format_bytes(cluster.gpu_memory)} each "
        f"({USABLE_FRACTION:.0%} usable: {format_bytes(USABLE_FRACTION * cluster.gpu_memory)})",
        f"{len(plan.ranked)} layout(s) estimated, {len(plan.fitting)} fit; {len(plan.refused)} refused by "
        f"paratrain's checks",
    ]


def _table(plan: Plan) -> list[str]:
    header = (
        f"{'#':>3}  {'layout':<38} {'params':>10} {'grads':>10} {'optim':>10} {'activ.':>10} {'working':>10} "
        f"{'total':>10} {'of GPU':>6}  {'comm/step':>10} {'x-node':>10} {'overhead':>9}  fits"
    )
    rows = [header]
    for index, estimate in enumerate(plan.ranked[:SHOWN_LAYOUTS], start=1):
        rows.append(_row(index, estimate, plan.cluster.gpu_memory))
    if len(plan.ranked) > SHOWN_LAYOUTS:
        rows.append(f"  ... {len(plan.ranked) - SHOWN_LAYOUTS} more")
    return rows


def _row(index: int, estimate: LayoutEstimate, gpu_memory: int) -> str:
    peak, traffic = estimate.peak, estimate.traffic
    cells = [
        format_bytes(value)
        for value in (peak.params, peak.grads, peak.optimizer, peak.activations, peak.working, peak.total)
    ]
    return (
        f"{index:>3}  {describe_layout(estimate.dims):<38} "
        + " ".join(f"{cell:>10}" for cell in cells)
        + f" {peak.total / gpu_memory:>6.0%}  {format_bytes(traffic.total):>10} {format_bytes(traffic.inter_node):>10}"
        + f" {format_seconds(estimate.overhead_seconds):>9}"
        + f"  {'yes' if estimate.fits(gpu_memory) else 'no'}"
    )


def _shorten(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_command(config_path: str, cluster: Cluster, dims: ParallelDims) -> str:
    """The ``paratrain train`` command line that runs this layout on the cluster."""
    return (
        f"paratrain train {config_path} --nproc-per-node {cluster.gpus_per_node} --nnodes {cluster.nodes} "
        + " ".join(layout_overrides(dims))
    )


def _verdict(plan: Plan, config_path: str) -> list[str]:
    best = plan.recommended
    if best is None:
        smallest = min(plan.ranked, key=lambda estimate: estimate.peak.total, default=None)
        hint = (
            f" the least memory is {describe_layout(smallest.dims)} at {format_bytes(smallest.peak.total)} per rank"
            if smallest
            else ""
        )
        return [
            f"no layout fits in {format_bytes(USABLE_FRACTION * plan.cluster.gpu_memory)} per GPU;{hint}. Try "
            f"parallel.activation_checkpointing=selective (or full), a smaller train.micro_batch_size, or more GPUs."
        ]
    command = run_command(config_path, plan.cluster, best.dims)
    degrees = best.dims.describe()
    return [
        f"recommended: {describe_layout(best.dims)} ({degrees}), {format_bytes(best.peak.total)} per rank",
        f"why: {recommendation_reason(plan)}.",
        f"run it: {command}",
    ]
