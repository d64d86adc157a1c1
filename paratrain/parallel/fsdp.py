"""FSDP2: ``fully_shard`` on each block the model declares, then on the root."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from paratrain.config.schema import FSDPConfig
from paratrain.models.plan_derivation import ParallelPlan

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, *, plan: ParallelPlan, options: FSDPConfig, roots: list[nn.Module] | None = None
) -> None:
    """Shards the model (in place) over ``mesh``: 1-D shards everywhere (fsdp); 2-D (replicate,
    shard) shards within and replicates across (hsdp).

    Each block is one unit, and each group of ``plan.outer_units`` (a transformers model's embedding;
    its final norm with the head), then each root takes the parameters left over: the model itself, or
    under pipeline parallel each stage module of this rank (``roots``).

    A model that declares no blocks is sharded as one unit, which gathers every parameter at once;
    it still saves optimizer and gradient memory, and the log says so.
    """
    common = {"mesh": mesh, "mp_policy": _mixed_precision(options), "offload_policy": _offload(options)}
    blocks = [model.get_submodule(path) for path in plan.blocks]
    if not blocks:
        logger.warning(
            "parallel.strategy=fsdp: the model declares no blocks (ParallelPlan.blocks); sharding it "
            "as one unit, so its whole parameter set is gathered for forward and backward"
        )
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: no point freeing them.
        reshard = options.reshard_after_forward and index < len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard, **common)
    for index, group in enumerate(plan.outer_units):
        modules = [model.get_submodule(path) for path in group]
        # The last group (norm and head) ends forward and starts backward, like the last block.
        reshard = options.reshard_after_forward and index < len(plan.outer_units) - 1
        fully_shard(modules if len(modules) > 1 else modules[0], reshard_after_forward=reshard, **common)
    # None lets FSDP keep the root's parameters (embeddings, head) gathered from forward into
    # backward, which needs them at once; an explicit True would free and gather them again.
    for root in roots if roots is not None else [model]:
        fully_shard(root, reshard_after_forward=None if options.reshard_after_forward else False, **common)
    if options.prefetch_blocks:
        _prefetch_explicitly(blocks, options.prefetch_blocks)
    root_count = len(roots) if roots is not None else 1
    logger.info(
        "fsdp: %d block unit(s), %d other unit(s) (%s), %d root(s), sharded over %d rank(s)",
        len(blocks),
        len(plan.outer_units),
        plan.describe_outer_units() or "none",
        root_count,
        mesh.size(),
    )


def apply_fsdp_to_experts(
    experts: list[nn.Module], mesh: DeviceMesh, *, options: FSDPConfig, data_parallel_ranks: int
) -> None:
    """Shards each expert module (its parameters DTensors over the ep mesh: expert parallel) over ``mesh``,
    the ranks holding the same experts, before their blocks are sharded (which then leave them out).

    Each expert's gradient already sums what every ep rank's tokens contributed (the all-to-all's
    backward), so it is divided by all ``data_parallel_ranks``, as the other parameters' gradients are
    averaged over them, not by the ranks of ``mesh`` alone (torchtitan does the same).
    """
    common = {"mesh": mesh, "mp_policy": _mixed_precision(options), "offload_policy": _offload(options)}
    for module in experts:
        fully_shard(module, reshard_after_forward=options.reshard_after_forward, **common)
        module.set_gradient_divide_factor(float(data_parallel_ranks))
        # A custom factor reduce-scatters with a pre-multiplied sum, which gloo lacks: force a plain sum and a
        # division after it. Not over one shard rank, where torch 2.13 divides the copied gradient by the
        # factor and then again after the (skipped) reduce-scatter.
        module.set_force_sum_reduction_for_comms(_shard_ranks(mesh) > 1)
    if experts:
        logger.info("fsdp: %d expert unit(s) sharded over %d rank(s) each", len(experts), mesh.size())


def _shard_ranks(mesh: DeviceMesh) -> int:
    return mesh.size(mesh.ndim - 1)  # hsdp's mesh: (replicate, shard)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether the next backward reduce-scatters gradients (False: keep accumulating unsharded)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def resolved_reduce_dtype(options: FSDPConfig) -> str | None:
    """The dtype gradients are reduced in (FSDPConfig.resolved_reduce_dtype)."""
    return options.resolved_reduce_dtype()


def _mixed_precision(options: FSDPConfig) -> MixedPrecisionPolicy:
    param = DTYPES[options.param_dtype] if options.param_dtype else None
    reduce_name = resolved_reduce_dtype(options)
    reduce = DTYPES[reduce_name] if reduce_name else None
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def _offload(options: FSDPConfig) -> OffloadPolicy:
    return CPUOffloadPolicy() if options.cpu_offload else OffloadPolicy()


def _prefetch_explicitly(blocks: list[nn.Module], depth: int) -> None:
    for index, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[index + 1 : index + 1 + depth])
        block.set_modules_to_backward_prefetch(list(reversed(blocks[max(0, index - depth) : index])))
