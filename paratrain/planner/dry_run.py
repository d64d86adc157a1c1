"""``paratrain train CONFIG --dry-run``: the layout of a world larger than this machine, in one process.

A fake process group (``torch.testing._internal.distributed.fake_pg``: collectives that move no data)
stands in for the world, so the real DeviceMesh is built and rank 0's model is laid out on the meta
device by the same ``parallelize`` training uses. Nothing is trained: no data is read, no
checkpoint or output directory is written, no memory is allocated for the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.config.factories import call_factory
from paratrain.config.schema import Config
from paratrain.errors import ConfigError
from paratrain.models.contract import HOOKS, DeclaresParallelPlan, hook_name, misspelt_hooks, provided_hooks
from paratrain.models.meta import on_meta
from paratrain.models.plan_derivation import ParallelPlan, plan_of
from paratrain.parallel.dims import MESH_DIMS, ParallelDims
from paratrain.parallel.parallelize import parallelize
from paratrain.parallel.sequence_sharding import local_token_indices
from paratrain.planner.accounting import FP32, StageShare, rank_memory, stage_shares
from paratrain.planner.command import activation_source
from paratrain.planner.inputs import PlanInputs, plan_inputs
from paratrain.planner.layouts import check_layout
from paratrain.planner.model_facts import read_model_facts
from paratrain.planner.units import format_bytes
from paratrain.tensors import local_part


@contextlib.contextmanager
def fake_process_group(world_size: int, *, rank: int = 0) -> Iterator[None]:
    """This process as ``rank`` of a ``world_size`` group whose collectives do nothing."""
    if dist.is_initialized():
        raise ConfigError("--dry-run runs in a process of its own; a process group already exists here")
    # lazy: pipeline building and torch's fake store load only for the dry run's layouts that use them
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def dry_run(config: Config, *, nproc_per_node: int, nnodes: int) -> str:
    """The layout per rank and the expected memory, as text.

    Raises:
        ConfigError: the layout does not fit the world size or the model (as ``paratrain train`` would say).
    """
    if nproc_per_node < 1 or nnodes < 1:
        raise ConfigError("--nproc-per-node and --nnodes must be >= 1")
    world_size = nproc_per_node * nnodes
    inputs = plan_inputs(config)
    facts = read_model_facts(inputs.model, seq_len=inputs.seq_len)
    dims = check_layout(inputs, facts, world_size=world_size, gpus_per_node=nproc_per_node)
    measured, source = activation_source(facts, inputs.data, read_data_sample=False)
    shares = stage_shares(facts, inputs, dims)
    memory = [rank_memory(facts, share, inputs, dims, measured_per_sample=measured) for share in shares]
    lines = [
        f"dry run: {world_size} ranks ({nnodes} node(s) x {nproc_per_node}), layout "
        f"{dims.strategy}: {dims.describe()}; nothing trained (no data read, nothing written)",
        *plan_lines(facts.plan, facts.model),
        *hook_lines(facts.model),
        *sequence_lines(dims, inputs.seq_len, inputs.parallel.cp_attention),
    ]
    if not dims.needs_process_group:
        return "\n".join([*lines, "one process, no process group", *_memory_lines(shares, memory, source)])
    with fake_process_group(world_size):
        dims = dims.with_mesh("cpu")
        model = build_rank0_on_meta(inputs, dims)
        ranks = dims.mesh.mesh.clone()
    lines += _parameter_lines(model, dims)
    lines += [
        f"rank 0 built on meta: {format_bytes(_local_bytes(model))} of fp32 parameters; "
        f"planner: {format_bytes(memory[0].params)}"
    ]
    lines += _memory_lines(shares, memory, source)
    lines += _group_lines(ranks, dims)
    lines += _rank_lines(ranks, shares, memory, nproc_per_node=nproc_per_node)
    return "\n".join(lines)


def plan_lines(plan: ParallelPlan, model: nn.Module) -> list[str]:
    """The parallel plan the layouts read, and where it came from (declared, or derived from a transformers
    model's ``_no_split_modules``, ``tp_plan`` and ``pp_plan``)."""
    if isinstance(model, DeclaresParallelPlan):
        source = "declared by the model"
    elif isinstance(model, nn.Sequential):
        source = "an nn.Sequential's children as the pipeline sequence"
    else:
        source = "derived from _no_split_modules, tp_plan and pp_plan" if plan.blocks else "none declared"
    blocks = (
        f"{len(plan.blocks)} ({plan.blocks[0]} ... {plan.blocks[-1]})" if len(plan.blocks) > 1 else str(plan.blocks)
    )
    tensor = ", ".join(f"{path}: {style}" for path, style in plan.block_tp_plan.items()) or "none (tp refused)"
    pipeline = f"{len(plan.pipeline_sequence)} pieces" if plan.pipeline_sequence else "none (pp refused)"
    if plan.pipeline_sequence:
        pipeline += f" ({plan.pipeline_sequence[0]} ... {plan.pipeline_sequence[-1]})"
    if plan.pipeline_layer_inputs is not None:
        pipeline += ", decoder layers fed rotary embeddings and causal masks"
    outer = plan.describe_outer_units()
    return [
        f"parallel plan ({source}): blocks (FSDP units, activation checkpointing, compile): {blocks}"
        + (f"; FSDP units besides: {outer}" if outer else ""),
        f"  tensor parallel per block: {tensor}; pipeline sequence: {pipeline}",
    ]


def sequence_lines(dims: ParallelDims, seq_len: int | None, exchange: str) -> list[str]:
    """Under context parallel, which tokens of each sequence every cp rank holds (the same on each
    data-parallel rank), and how attention reaches the others'."""
    if not dims.cp_enabled:
        return []
    exchange = "all_to_all" if exchange == "auto" else exchange
    if not isinstance(seq_len, int) or seq_len % (2 * dims.cp):
        return [f"context parallel: cp={dims.cp} ({exchange}); sequence length unknown, slices not shown"]
    slices = []
    for cp_rank in range(dims.cp):
        indices = local_token_indices(seq_len, cp=dims.cp, cp_rank=cp_rank).tolist()
        half = len(indices) // 2
        slices.append(f"cp rank {cp_rank}: {indices[0]}-{indices[half - 1]} and {indices[half]}-{indices[-1]}")
    return [
        f"context parallel: cp={dims.cp} ({exchange} exchange in attention); tokens of each {seq_len}-token "
        f"sequence held: {'; '.join(slices)}"
    ]


def hook_lines(model: nn.Module) -> list[str]:
    """Which of the model contract's hooks (models/contract.py) the model defines, and any method whose
    name is one letter away from a hook's, which paratrain ignores."""
    provided = provided_hooks(model)
    missing = [hook_name(hook) for hook in HOOKS if hook_name(hook) not in provided]
    line = f"model hooks: {', '.join(f'{name}()' for name in provided) or 'none'}"
    line += f"; not defined: {', '.join(f'{name}()' for name in missing)}" if missing else ""
    return [line, *(f"  warning: {message}" for message in misspelt_hooks(model))]


def build_rank0_on_meta(inputs: PlanInputs, dims: ParallelDims) -> nn.Module:
    """Rank 0's model on meta, laid out by the functions training uses, stopped before materialising."""

    def factory() -> nn.Module:
        return call_factory(inputs.model, key="model")

    if dims.pp > 1:
        # lazy: pipeline building and torch's fake store load only for the dry run's layouts that use them
        from paratrain.parallel.pipeline.assembly import lay_out_stages, pipeline_shape

        shape = pipeline_shape(inputs.pipeline, dims=dims, train=inputs.train)
        return lay_out_stages(factory, dims, parallel=inputs.parallel, pipeline=inputs.pipeline, shape=shape).model
    with on_meta():
        model = factory()
    parallelize(model, dims, plan=plan_of(model), options=inputs.parallel)
    return model


def _local_bytes(model: nn.Module) -> int:
    return sum(local_part(param).numel() * FP32 for param in model.parameters())


def _parameter_lines(model: nn.Module, dims: ParallelDims) -> list[str]:
    """How rank 0 holds each kind of parameter (repeated blocks shown once, as blocks.*, per distinct shape)."""
    replicated_over = [name for name in MESH_DIMS if getattr(dims, name) > 1]
    lines, seen = ["parameters on rank 0 (full shape -> local shape: placement per mesh dimension):"], set()
    for name, param in model.named_parameters():
        pattern = ".".join("*" if part.isdigit() else part for part in name.split("."))
        if (pattern, param.shape) in seen:
            continue
        seen.add((pattern, param.shape))
        if isinstance(param, DTensor):
            placements = ", ".join(
                f"{placement} on {dim}" for placement, dim in zip(param.placements, param.device_mesh.mesh_dim_names)
            )
        else:
            placements = "whole on this rank, replicated over " + (" x ".join(replicated_over) or "nothing")
        lines.append(f"  {pattern}: {list(param.shape)} -> {list(local_part(param).shape)}: {placements}")
    return lines


def _memory_lines(shares: list[StageShare], memory, source: str) -> list[str]:
    lines = [f"expected memory per rank (planner; activations: {source}):"]
    for share, rank in zip(shares, memory):
        where = f"pp rank {share.pp_rank}" if len(shares) > 1 else "every rank"
        lines.append(
            f"  {where}: params {format_bytes(rank.params)}, grads {format_bytes(rank.grads)}, optimizer "
            f"{format_bytes(rank.optimizer)}, activations {format_bytes(rank.activations)}, working "
            f"{format_bytes(rank.working)}: total {format_bytes(rank.total)}"
        )
    return lines


def _group_lines(ranks: torch.Tensor, dims: ParallelDims) -> list[str]:
    """The rank groups along each mesh dimension of size > 1, as the mesh lays them out."""
    lines = ["rank groups (from the mesh):"]
    for axis, name in enumerate(MESH_DIMS):
        lines += _groups_along(ranks, axis, name, getattr(dims, name))
    if dims.ep_enabled:
        # ep's view of dp_shard x cp (ParallelDims.with_mesh): (efsdp, ep), ep inner.
        experts = ranks.reshape(dims.pp, dims.dp_replicate, dims.efsdp, dims.ep, dims.tp)
        lines += _groups_along(experts, 3, "ep (divide the experts)", dims.ep)
        lines += _groups_along(experts, 2, "efsdp (shard the same experts)", dims.efsdp)
    return lines


def _groups_along(ranks: torch.Tensor, axis: int, name: str, size: int) -> list[str]:
    if size == 1:
        return []
    groups = ranks.movedim(axis, -1).reshape(-1, size).tolist()
    shown = "; ".join(_span(group) for group in groups[:3]) + ("; ..." if len(groups) > 3 else "")
    return [f"  {name}: {len(groups)} group(s) of {size}: {shown}"]


def _span(group: list[int]) -> str:
    step = group[1] - group[0] if len(group) > 1 else 1
    if len(group) > 3 and all(b - a == step for a, b in zip(group, group[1:])):
        return f"[{group[0]}, {group[1]}, ..., {group[-1]}]"
    return str(group)


def _rank_lines(ranks: torch.Tensor, shares: list[StageShare], memory, *, nproc_per_node: int) -> list[str]:
    lines = [
        "ranks (node/local: mesh coordinates pp, dp_replicate, dp_shard, cp, tp; pipeline pieces; expected memory):"
    ]
    for rank in range(ranks.numel()):
        coords = [int(value) for value in (ranks == rank).nonzero()[0]]
        share, held = shares[coords[0]], memory[coords[0]]
        pieces = _pieces_text(share.pieces)
        lines.append(
            f"  rank {rank:>4} node {rank // nproc_per_node}/{rank % nproc_per_node}: "
            f"({', '.join(map(str, coords))})  {pieces}  {format_bytes(held.total)}"
        )
    return lines


def _pieces_text(pieces: tuple[str, ...]) -> str:
    if len(pieces) <= 3:
        return ", ".join(pieces)
    return f"{pieces[0]} .. {pieces[-1]} ({len(pieces)} pieces)"
