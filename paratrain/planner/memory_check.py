"""Before any parameter is allocated: will the layout fit, and which layout ``parallel.strategy: auto`` trains.

Both use the planner's own estimate (ranking.py, accounting.py) on the model built on the meta device,
so ``paratrain train`` refuses a model too large for the machine in seconds, with the numbers and a
layout that fits, instead of allocating until the allocator fails minutes later with a traceback.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from paratrain.config.schema import Config, TrainConfig
from paratrain.errors import ConfigError
from paratrain.launch.process_group import pick_device
from paratrain.parallel.dims import ParallelDims, resolve_parallel_dims
from paratrain.planner.host_memory import DeviceKind, NodeHostMemory, host_memory_fix, meminfo
from paratrain.planner.inputs import PlanInputs, parallel_with_layout, plan_inputs
from paratrain.planner.layouts import Cluster, describe_layout
from paratrain.planner.model_facts import ModelFacts, read_model_facts
from paratrain.planner.presentation import describe_node_host, run_command
from paratrain.planner.ranking import LayoutEstimate, estimate_layout, rank_layouts
from paratrain.planner.units import format_bytes, parse_memory

logger = logging.getLogger("paratrain")

# More nodes of the same size the refusal looks for when no layout fits the processes given.
_LARGEST_NODE_COUNT = 64
# One-process layouts over several devices: the planner does not model them.
_NOT_ESTIMATED = ("dp", "model_parallel")


class MemoryRefused(ConfigError):
    """The memory check's refusal; also carries the numbers, for the one-line note of a rank other than 0."""

    def __init__(self, message: str, *, needed: int, free: FreeMemory, per: str = "per process"):
        super().__init__(message)
        self.needed, self.free, self.per = needed, free, per


@dataclass(frozen=True)
class FreeMemory:
    """Memory one process may use, and where the number comes from (for the message)."""

    bytes: int
    source: str


def free_memory(device: torch.device, *, local_world_size: int) -> FreeMemory:
    """Free memory of this process's GPU, or its share of the machine's available RAM on CPU (the
    processes of a node share it)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return FreeMemory(free, f"free on {device} (torch.cuda.mem_get_info)")
    available = meminfo("MemAvailable")
    share = f" / {local_world_size} processes on this node" if local_world_size > 1 else ""
    return FreeMemory(available // local_world_size, f"MemAvailable in /proc/meminfo{share}")


def total_memory(device: torch.device, *, local_world_size: int) -> int:
    """What ``auto`` ranks layouts against: the same on every rank (free memory moves between reads)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return meminfo("MemTotal") // local_world_size


def available_host_memory(train: TrainConfig) -> FreeMemory:
    """The RAM a node's processes may use: ``train.host_memory`` when set, else MemAvailable.

    Raises:
        ConfigError: a train.host_memory that is not a memory size.
    """
    if train.host_memory is not None:
        return FreeMemory(parse_memory(train.host_memory, argument="train.host_memory"), "train.host_memory")
    return FreeMemory(meminfo("MemAvailable"), "MemAvailable in /proc/meminfo")


def check_memory_fits(
    config: Config,
    dims: ParallelDims,
    free: FreeMemory,
    *,
    nnodes: int,
    config_path: str = "CONFIG",
    device: DeviceKind = "cuda",
) -> LayoutEstimate | None:
    """Refuses a layout whose fullest rank needs more than the free memory.

    Args:
        device: Whether the processes train on GPUs or on the CPU: what the estimate's host memory counts.

    Returns:
        The estimate (None when this layout or model is not one the planner estimates; a log line says so).

    Raises:
        ConfigError: naming the estimate, what is free, the planner's layout that fits and its command.
    """
    if dims.strategy in _NOT_ESTIMATED:
        logger.info("memory check skipped: the planner does not estimate parallel.strategy=%s", dims.strategy)
        return None
    inputs = plan_inputs(config)
    facts = _facts_or_none(inputs)
    if facts is None:
        return None
    per_node = dims.world_size // nnodes
    estimate = estimate_layout(facts, inputs, dims, gpus_per_node=per_node, measured_per_sample=None, device=device)
    if estimate.peak.total > free.bytes:
        message = _refusal(facts, inputs, estimate, free, nnodes=nnodes, config_path=config_path)
        raise MemoryRefused(message, needed=estimate.peak.total, free=free)
    return estimate


def check_host_memory_fits(config: Config, estimate: LayoutEstimate, available: FreeMemory) -> NodeHostMemory:
    """Refuses a layout whose fullest node's processes need more host memory than ``available``
    (planner/host_memory.py: init, resume and training, on GPU runs as on CPU runs).

    Raises:
        MemoryRefused: naming the estimate per node, what each process holds, what is available and the fix.
    """
    node = estimate.host
    if node.per_node <= available.bytes:
        return node
    message = "\n".join(
        [
            f"the layout {describe_layout(estimate.dims)} needs an estimated {format_bytes(node.per_node)} of host "
            f"memory per node, but only {format_bytes(available.bytes)} is available ({available.source}): "
            f"{describe_node_host(node)}",
            f"{host_memory_fix(node, plan_inputs(config))} If the node has more for this run than that, set "
            f"train.host_memory=SIZE.",
            "To start anyway, pass --skip-memory-check (or set train.check_memory=false).",
        ]
    )
    raise MemoryRefused(message, needed=node.per_node, free=available, per="of host memory per node")


def _facts_or_none(inputs: PlanInputs) -> ModelFacts | None:
    try:
        return read_model_facts(inputs.model, seq_len=inputs.seq_len)
    except ConfigError as error:  # a model the planner cannot read may still train: say why it is not checked
        logger.warning("warning: memory check skipped: %s", error)
        return None


def _refusal(
    facts: ModelFacts, inputs: PlanInputs, estimate: LayoutEstimate, free: FreeMemory, *, nnodes: int, config_path: str
) -> str:
    peak = estimate.peak
    lines = [
        f"the model ({inputs.model.factory}, {facts.num_params:,} parameters) does not fit: the layout "
        f"{describe_layout(estimate.dims)} needs an estimated {format_bytes(peak.total)} per process (parameters "
        f"{format_bytes(peak.params)}, gradients {format_bytes(peak.grads)}, optimizer state "
        f"{format_bytes(peak.optimizer)}, activations {format_bytes(peak.activations)}, working "
        f"{format_bytes(peak.working)}), but only {format_bytes(free.bytes)} is free ({free.source})",
        _recommendation(facts, inputs, free.bytes, processes=estimate.dims.world_size, nnodes=nnodes, path=config_path),
        "To start anyway, pass --skip-memory-check (or set train.check_memory=false).",
    ]
    return "\n".join(lines)


def _recommendation(
    facts: ModelFacts, inputs: PlanInputs, memory: int, *, processes: int, nnodes: int, path: str
) -> str:
    """The planner's layout for these processes, else for the fewest more nodes of the same size."""
    per_node = processes // nnodes
    for nodes in _node_counts(nnodes):
        cluster = Cluster(per_node * nodes, nodes, memory)
        best = rank_layouts(facts, inputs, cluster, measured_per_sample=None).fitting
        if best:
            where = "with these processes" if nodes == nnodes else f"on {nodes} nodes of {per_node} process(es)"
            return (
                f"The planner's layout that fits {where}: {describe_layout(best[0].dims)}, "
                f"{format_bytes(best[0].peak.total)} per process; run it: {run_command(path, cluster, best[0].dims)}"
            )
    return (
        f"No layout fits on up to {_LARGEST_NODE_COUNT} nodes of {per_node} process(es) with this memory; try "
        f"parallel.activation_checkpointing=selective (or full), a smaller train.micro_batch_size or a smaller model "
        f"(see `paratrain plan {path} --gpus N --gpu-memory SIZE`)."
    )


def _node_counts(nnodes: int) -> list[int]:
    """These nodes, then twice as many, four times... (each count is a full ranking of the layouts)."""
    counts = [nnodes]
    while counts[-1] * 2 <= _LARGEST_NODE_COUNT:
        counts.append(counts[-1] * 2)
    return counts


def resolve_auto_layout(config: Config, *, world_size: int, nnodes: int, memory: int) -> Config:
    """``parallel.strategy: auto``: the config with the layout the planner recommends for this world size
    (ranked against ``memory`` per process), every degree explicit; other configs unchanged.

    Raises:
        ConfigError: degrees set beside auto, or a model the planner cannot read.
    """
    parallel = config.parallel
    if parallel.strategy != "auto":
        return config
    given = [f"parallel.{name}={value}" for name, value in parallel.degrees().items() if value is not None]
    if given:
        raise ConfigError(
            f"parallel.strategy=auto chooses every degree, but {', '.join(given)} is set; remove the degrees "
            f"or name a strategy"
        )
    inputs = plan_inputs(config)
    facts = read_model_facts(inputs.model, seq_len=inputs.seq_len)
    plan = rank_layouts(facts, inputs, Cluster(world_size, nnodes, memory), measured_per_sample=None)
    # None fits: take the least memory, and let the memory check say why it does not fit.
    chosen = plan.recommended or min(plan.ranked, key=lambda estimate: estimate.peak.total, default=None)
    if chosen is None:
        reasons = "; ".join(f"{describe_layout(dims)}: {reason.splitlines()[0]}" for dims, reason in plan.refused)
        raise ConfigError(f"parallel.strategy=auto: no layout of {world_size} process(es) can run: {reasons}")
    return config.model_copy(update={"parallel": parallel_with_layout(parallel, chosen.dims)})


def maybe_resolve_auto(config: Config, *, world_size: int, nproc_per_node: int) -> Config:
    """resolve_auto_layout on this machine's memory, logging the choice; the config as it is without auto."""
    if config.parallel.strategy != "auto":
        return config
    device = pick_device(config.train.device, 0)
    memory = total_memory(device, local_world_size=nproc_per_node)
    config = resolve_auto_layout(config, world_size=world_size, nnodes=world_size // nproc_per_node, memory=memory)
    chosen = resolve_parallel_dims(config.parallel, world_size=world_size, local_world_size=nproc_per_node)
    logger.info("%s", describe_auto_choice(chosen))
    return config


def check_memory(
    config: Config, dims: ParallelDims, *, rank: int, local_rank: int, local_world_size: int, config_path: str
) -> str | None:
    """check_memory_fits for this process's device and, on local rank 0 (once per node), check_host_memory_fits
    for the node's RAM, unless train.check_memory=false; logs the verdict and returns it (None when this
    layout or model is not estimated).

    Only rank 0 prints a user error's message; another rank that refuses (its GPU has less free than rank
    0's, its node less RAM) says so in one line, so a refusal is never silent and never repeated in full.
    """
    if not config.train.check_memory:
        logger.info("memory check skipped (train.check_memory=false)")
        return "memory check skipped (train.check_memory=false)"
    device = pick_device(config.train.device, local_rank)
    free = free_memory(device, local_world_size=local_world_size)
    nnodes = max(1, dims.world_size // local_world_size)
    kind: DeviceKind = "cuda" if device.type == "cuda" else "cpu"
    try:
        estimate = check_memory_fits(config, dims, free, nnodes=nnodes, config_path=config_path, device=kind)
        host = _maybe_check_host(config, estimate, local_rank=local_rank)
    except MemoryRefused as refused:
        if rank != 0:
            logger.warning(
                "memory check refused: an estimated %s %s, %s free (%s)",
                format_bytes(refused.needed),
                refused.per,
                format_bytes(refused.free.bytes),
                refused.free.source,
            )
        raise
    if estimate is None:
        return None
    verdict = (
        f"memory check: {format_bytes(estimate.peak.total)} per process estimated, {format_bytes(free.bytes)} "
        f"free ({free.source}){host}"
    )
    logger.info("%s", verdict)
    return verdict


def _maybe_check_host(config: Config, estimate: LayoutEstimate | None, *, local_rank: int) -> str:
    """check_host_memory_fits on local rank 0 (the node's processes share its RAM); the verdict's clause."""
    if estimate is None or local_rank != 0:
        return ""
    available = available_host_memory(config.train)
    node = check_host_memory_fits(config, estimate, available)
    return (
        f"; host memory {format_bytes(node.per_node)} per node estimated, {format_bytes(available.bytes)} "
        f"available ({available.source})"
    )


def describe_auto_choice(dims: ParallelDims) -> str:
    """The log line naming the layout auto chose (the degrees of the config resolve_auto_layout returned)."""
    return f"parallel.strategy=auto: training with the planner's layout {dims.strategy} ({dims.describe()})"
