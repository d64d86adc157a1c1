"""Tensor parallel on DTensor: each block's linear layers split across ``mesh["tp"]`` as the model's
plan declares (``parallelize_module`` with torch's parallel styles).

A plan's styles (models/contract.py ``TensorParallelStyle``) map onto torch's:

==============================  ===============================================================
colwise                         ``ColwiseParallel()``: output features split, left split
rowwise                         ``RowwiseParallel()``: input features split, output all-reduced
colwise_gather_output           ``ColwiseParallel(output_layouts=Replicate())``: split, then gathered
rowwise_split_input             ``RowwiseParallel(input_layouts=Replicate())``: a whole input split
replicated_with_grad_allreduce  ``SequenceParallel(sequence_dim=2)`` (local output) on a per-head norm: its input is
                                (batch, seq, heads, head_dim) with this rank's heads, i.e. dim 2
                                sharded; the weight stays whole (Replicate) and DTensor sums its
                                gradient over the ranks, as the style's name asks
==============================  ===============================================================
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from paratrain.errors import ConfigError
from paratrain.models.plan_derivation import ParallelPlan


def check_tensor_parallel_plan(plan: ParallelPlan, tp: int, *, sequence_parallel: bool = False) -> None:
    """Raises ConfigError when the model declares no plan, or tp does not divide its sizes."""
    extra = sorted({kind for kind in plan.block_tp_plan.values() if kind not in ("colwise", "rowwise")})
    if sequence_parallel and extra:
        raise ConfigError(
            f"parallel.sequence_parallel=true: the model's tensor-parallel plan uses {', '.join(extra)}, which "
            "paratrain applies with replicated activations only; set parallel.sequence_parallel=false"
        )
    if plan.tp_unsupported:
        raise ConfigError(
            f"parallel.tp={tp}: the model's tensor-parallel plan uses styles paratrain does not apply "
            f"({', '.join(plan.tp_unsupported)}); paratrain applies {', '.join(STYLES)}; use fsdp/ddp"
        )
    if sequence_parallel and plan.block_tp_plan and not plan.block_norms:
        raise ConfigError(
            "parallel.sequence_parallel=true: the model's plan names no norm layers to shard along the sequence "
            "(ParallelPlan.block_norms; a transformers model's derived plan has none); set it to false"
        )
    if not plan.block_tp_plan:
        raise ConfigError(
            f"parallel.tp={tp}: the model declares no tensor-parallel plan; give it a parallel_plan() method "
            f"returning ParallelPlan(blocks=..., block_tp_plan={{'attn.q_proj': 'colwise', ...}}) "
            f"(see paratrain/models/gpt.py), or use fsdp/ddp"
        )
    for key, size in plan.tp_divisible.items():
        if size % tp:
            raise ConfigError(f"parallel.tp={tp} does not divide {key}={size}; use a tp degree that divides it")


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, *, plan: ParallelPlan, sequence_parallel: bool) -> None:
    """Shards each block's planned linear layers over the 1-D ``mesh`` (in place).

    Without sequence parallel, blocks take and return replicated activations. With it, the
    activations between blocks and the norms are sharded along the sequence dimension (dim 1), and
    the embedding output and the final norm's input are converted at the edges.
    """
    for block_path in plan.blocks:
        block = model.get_submodule(block_path)
        # A transformers MoE plan names both feed-forwards (dense mlp.gate_proj, shared_experts.*): each block has one.
        layer_plan = {
            path: _style(kind, sequence_parallel) for path, kind in plan.block_tp_plan.items() if _has(block, path)
        }
        if sequence_parallel:
            layer_plan.update({norm: SequenceParallel() for norm in plan.block_norms})
        parallelize_module(block, mesh, layer_plan)
    if sequence_parallel:
        _shard_sequence_at_block_edges(model, mesh, plan)


def _has(block: nn.Module, path: str) -> bool:
    try:
        block.get_submodule(path)
    except AttributeError:
        return False
    return True


STYLES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=2, use_local_output=True),
}


def _style(kind: str, sequence_parallel: bool):
    if not sequence_parallel:
        return STYLES[kind]()
    if kind == "colwise":  # gathers the sequence-sharded input that the preceding norm produced
        return ColwiseParallel(input_layouts=Shard(1))
    return RowwiseParallel(output_layouts=Shard(1))  # reduce-scatters back to sequence shards


def _shard_sequence_at_block_edges(model: nn.Module, mesh: DeviceMesh, plan: ParallelPlan) -> None:
    """The first block receives replicated activations and splits them; after the last block they
    are gathered again so the rest of the model sees ordinary tensors."""
    first, last = model.get_submodule(plan.blocks[0]), model.get_submodule(plan.blocks[-1])
    parallelize_module(
        first,
        mesh,
        PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True),
    )
    last.register_forward_hook(_gather_sequence(mesh))


def _gather_sequence(mesh: DeviceMesh):

    def hook(module, inputs, output):
        return DTensor.from_local(output, mesh, (Shard(1),)).full_tensor()

    return hook
