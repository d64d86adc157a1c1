"""Host memory (RAM) of a layout: what each process holds in the CPU's memory at its fullest moment, and
what a node of them needs, on GPU runs as on CPU runs (docs/planner.md, "Host memory").

A process holds its runtime and, at its fullest, the largest of three phases:

- init, the model materialised (models/init.py): its shard of the parameters plus one full tensor, the
  largest, read from ``model.pretrained`` or drawn by name (an ``init_parameter`` hook, a transformers
  model). A model from scratch that has neither is built whole for real instead: by every process in a
  layout that neither shards nor pipelines it (each then moves it to its device), by rank 0 alone in one
  that does (a seed build each rank takes its slice of);
- resume: its shard plus DCP's read buffer. torch's FileSystemReader loads one stored piece of a tensor at
  a time; the piece is assumed to be a whole tensor, the largest, as a checkpoint saved unsharded holds;
- training: on CPU runs the rank's whole estimate (model state, activations, working set); on GPU runs
  nothing, unless FSDP offloads its shards of parameters, gradients and optimizer state
  (``parallel.fsdp.cpu_offload``). With ``checkpoint.async_save`` a host copy of the rank's parameters and
  optimizer state (pinned on GPUs) is kept from the first save to the end of the run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from torch import nn

from paratrain.errors import ConfigError
from paratrain.models.contract import declares_init
from paratrain.models.hf import is_transformers_model
from paratrain.parallel.dims import ParallelDims
from paratrain.planner.accounting import FP32, RankMemory
from paratrain.planner.inputs import PlanInputs
from paratrain.planner.model_facts import ModelFacts

DeviceKind = Literal["cpu", "cuda"]
InitKind = Literal["by tensor", "whole build", "seed build"]

# torch and paratrain imported, the process group up: 357 MB of resident memory measured for a one-process run
# of examples/quickstart.yaml on CPU (/usr/bin/time). On GPUs the CUDA context, cuBLAS and NCCL come on top:
# assumed 2 GiB, not measured here (pytorch#113326 reports 2 GB resident once a process has touched CUDA).
RUNTIME_BYTES: dict[DeviceKind, int] = {"cpu": 360 * 2**20, "cuda": 2 * 2**30}


@dataclass(frozen=True)
class HostMemory:
    """Bytes of host memory one process holds: its runtime, and each phase's own bytes beside it."""

    runtime: int
    init: int
    resume: int  # 0 when the run never resumes (checkpoint.resume=never)
    training: int

    @property
    def phases(self) -> dict[str, int]:
        return {"init": self.init, "resume": self.resume, "training": self.training}

    @property
    def fullest_phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__)

    @property
    def total(self) -> int:
        return self.runtime + max(self.phases.values())


@dataclass(frozen=True)
class NodeHostMemory:
    """The host memory of the fullest node: the one holding rank 0, whose seed build (when the model has one)
    is the whole model.

    Attributes:
        processes: Processes on the node.
        first: Rank 0's host memory.
        other: Every other process's.
        init_kind: How the model is initialised: ``by tensor`` (a shard plus one full tensor at a time),
            ``whole build`` (every process builds it whole) or ``seed build`` (rank 0 builds it whole).
        device: Whether the processes train on GPUs or on the CPU.
    """

    processes: int
    first: HostMemory
    other: HostMemory
    init_kind: InitKind
    device: DeviceKind

    @property
    def per_node(self) -> int:
        return self.first.total + (self.processes - 1) * self.other.total

    def fits(self, host_memory: int | None) -> bool:
        """Whether the node's processes fit ``host_memory`` bytes (None: not judged, so yes)."""
        return host_memory is None or self.per_node <= host_memory


def node_host_memory(
    facts: ModelFacts, inputs: PlanInputs, rank: RankMemory, dims: ParallelDims, *, device: DeviceKind, processes: int
) -> NodeHostMemory:
    """The host memory of the fullest node of this layout, whose fullest rank holds ``rank`` on its device."""
    kind = init_kind(facts.model, pretrained=inputs.model.pretrained is not None, dims=dims)
    largest = FP32 * max(param.numel for param in facts.params)
    whole = FP32 * facts.num_params
    resumes = inputs.checkpoint.resume != "never"
    other = HostMemory(
        runtime=RUNTIME_BYTES[device],
        init=whole if kind == "whole build" else rank.params + largest,
        resume=rank.params + largest if resumes else 0,
        training=training_bytes(rank, inputs, dims, device=device),
    )
    first = replace(other, init=whole) if kind == "seed build" else other
    return NodeHostMemory(processes, first, other, kind, device)


def init_kind(model: nn.Module, *, pretrained: bool, dims: ParallelDims) -> InitKind:
    """How models/init.py and layout/flat.py initialise this model in this layout (see the module docstring)."""
    if pretrained or declares_init(model):
        return "by tensor"
    if not (dims.is_sharded or dims.pp_enabled):
        return "whole build"
    return "by tensor" if is_transformers_model(model) else "seed build"


def training_bytes(rank: RankMemory, inputs: PlanInputs, dims: ParallelDims, *, device: DeviceKind) -> int:
    """What a process holds in host memory while it trains (see the module docstring)."""
    on_host = rank.total if device == "cpu" else 0
    if device == "cuda" and dims.fsdp_enabled and inputs.parallel.fsdp.cpu_offload:
        on_host = rank.model_state
    async_copy = rank.params + rank.optimizer if inputs.checkpoint.async_save else 0
    return on_host + async_copy


def host_memory_fix(node: NodeHostMemory, inputs: PlanInputs) -> str:
    """What to change so that the node's processes hold less, by what fills the fullest of them."""
    fullest = node.first
    if fullest.fullest_phase == "init" and node.init_kind == "whole build":
        return (
            "Every process builds the whole model before moving it to its device: shard it (parallel.dp_shard, "
            "parallel.tp or parallel.pp) so that each holds its slice, or start from model.pretrained."
        )
    if fullest.fullest_phase == "init" and node.init_kind == "seed build":
        return (
            "Rank 0 builds the whole model once, since the model has no init_parameter(name, tensor, generator) "
            "hook: give it one (docs/models.md), or start from model.pretrained, so that no process holds it whole."
        )
    training = fullest.fullest_phase == "training"
    fixes = []
    if training and inputs.checkpoint.async_save:
        fixes.append("checkpoint.async_save=false (no host copy of each process's parameters and optimizer state)")
    if training and node.device == "cuda" and inputs.parallel.fsdp.cpu_offload:
        fixes.append("parallel.fsdp.cpu_offload=false (the shards stay on the GPUs)")
    fixes.append("fewer processes per node over more nodes (--nproc-per-node, --nnodes)")
    fixes.append("more sharding (parallel.dp_shard, parallel.tp, parallel.pp)")
    return "To hold less per node: " + "; ".join(fixes) + "."


def meminfo(field: str) -> int:
    """A field of /proc/meminfo (MemTotal, MemAvailable), in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0]) * 1024  # reported in kB
    raise ConfigError(f"/proc/meminfo has no {field}; pass --skip-memory-check (train.check_memory=false)")
