"""Global gradient norm and clipping over plain, sharded (DTensor) and mixed gradients.

torch's ``get_total_norm`` handles a list of plain tensors or of DTensors on one mesh, but not a mix
(tensor parallel leaves embeddings and norms as plain tensors beside sharded linears, and fsdp + tp
has DTensors on two meshes). So norms are taken per group of like gradients and combined. A group of
DTensors cut into shards and copies only (Shard, Replicate) sums its shards' squared norms over the
mesh dimensions that cut it: DTensor's own norm does the same, but worked out its sharding for each op
anew in a fresh process (23 ms of the first step on the tests' tiny GPT under fsdp, which every live
replica group waits for after a restart; 2.2 ms each later step). Other groups (Partial gradients) take
DTensor's norm, made global with ``full_tensor()``. Clipping scales each gradient's local part by
torch's coefficient (``clip_grads_with_norm_``'s): a scalar scales every placement alike, and on
DTensors the same multiplication first cost DTensor's sharding propagation ~0.2 s per new mesh, the
first step of every run (docs/benchmarks.md, the suite's section).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from paratrain.tensors import local_part


def clip_grad_norm(
    params: list[torch.nn.Parameter], max_norm: float | None, *, sum_over: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Scales gradients so their global norm is at most max_norm (None: only measure it).

    Args:
        sum_over: Ranks holding other parameters of the same model (pipeline stages), whose
            squared norms add to this rank's.

    Returns the 2-norm of all gradients together before clipping: a plain scalar, equal on every rank.
    """
    groups = _group_like_gradients(params)
    norms = [_group_norm([p.grad for p in group]) for group in groups]
    if not norms and sum_over is None:
        return torch.zeros(())
    device = norms[0].device if norms else params[0].device
    total = (
        torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))
        if norms
        else torch.zeros((), device=device)
    )
    if sum_over is not None:
        squared = total.square()
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=sum_over)
        total = squared.sqrt()
    if max_norm is not None:
        _scale_gradients(groups, max_norm, total)
    return total


def _scale_gradients(groups: list[list[torch.nn.Parameter]], max_norm: float, total: torch.Tensor) -> None:
    """torch's ``clip_grads_with_norm_`` on the local parts: the same coefficient, the same multiply."""
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    alike: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for group in groups:
        for param in group:
            local = local_part(param.grad)
            alike[(local.device, local.dtype)].append(local)
    with torch.no_grad():
        for (device, _), grads in alike.items():
            torch._foreach_mul_(grads, coefficient.to(device))


def _group_like_gradients(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    groups: dict[object, list[torch.nn.Parameter]] = defaultdict(list)
    for param in params:
        if param.grad is not None:
            groups[_group_key(param.grad)].append(param)
    return list(groups.values())


def _group_key(grad: torch.Tensor) -> object:
    if isinstance(grad, DTensor):
        return ("dtensor", id(grad.device_mesh), grad.placements)
    return ("tensor", grad.device)


def _group_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of a group of like gradients (``_group_key``), a plain scalar equal on every rank."""
    first = grads[0]
    if isinstance(first, DTensor) and all(
        placement.is_shard() or placement.is_replicate() for placement in first.placements
    ):
        return _norm_over_shards(first, [grad.to_local() for grad in grads])
    return _as_plain(torch.nn.utils.get_total_norm(grads))


def _norm_over_shards(like: DTensor, shards: list[torch.Tensor]) -> torch.Tensor:
    """The whole gradients' 2-norm from this rank's ``shards`` of DTensors cut as ``like``: each mesh dimension
    that shards them splits their elements among its ranks (their squares add up), one that replicates them gives
    each rank the same (counted once)."""
    squared = torch.nn.utils.get_total_norm(shards).square()
    for mesh_dim, placement in enumerate(like.placements):
        if placement.is_shard():
            dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=like.device_mesh.get_group(mesh_dim))
    return squared.sqrt()


def _as_plain(norm: torch.Tensor) -> torch.Tensor:
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
