"""DistributedDataParallel over the replicas' mesh (``ParallelDims.ddp_mesh``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    device: torch.device,
    bucket_cap_mb: float | None,
    static_graph: bool,
    find_unused_parameters: bool,
    gradient_as_bucket_view: bool,
) -> DistributedDataParallel:
    """Wraps a model already on its device; gradients are averaged over ``mesh`` (the replicas' 1-D mesh)."""
    # Passing bucket_cap_mb at all turns off DDP's small first bucket, so pass it only when set.
    bucket = {"bucket_cap_mb": bucket_cap_mb} if bucket_cap_mb is not None else {}
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=mesh.get_group(),
        **bucket,
        static_graph=static_graph,
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=gradient_as_bucket_view,
    )


def settle_buckets(model: nn.Module, run_step: Callable[[], object], *, device: torch.device) -> None:
    """Brings DDP past its first iteration now, leaving weights, gradients, buffers and RNG as they were.

    DDP reduces the first iteration's gradients in one bucket in parameter order, then rebuilds its
    buckets in the order gradients become ready. Where a gradient lies in a bucket decides the order
    in which the ranks' values are summed (a ring all-reduce gives each rank one chunk of the bucket
    to reduce), and with more than two ranks another order rounds differently. A run resumed from a
    checkpoint would reduce its first step in the first iteration's layout, where the uninterrupted
    run had the rebuilt one: at 4 ranks the final weights differed by about 1e-7. DDP around a
    pipeline stage rebuilds nothing (find_unused_parameters), yet a resumed ddp x pp run still
    differed by about 1e-7 in the first stage's weights after its first iteration. One throw-away
    step after a resume gives every step the state the uninterrupted run's had.

    Args:
        model: The layout's model, or a pipeline's stages; one without DistributedDataParallel is left alone.
        run_step: Forwards and backwards, gradients synchronised, as a training step runs them.
        device: This rank's device, whose random number generator is restored too.
    """
    if not any(isinstance(module, DistributedDataParallel) for module in model.modules()):
        return
    buffers = [buffer.detach().clone() for buffer in model.buffers()]  # e.g. BatchNorm's running statistics
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        run_step()
    with torch.no_grad():
        for buffer, saved in zip(model.buffers(), buffers):
            buffer.copy_(saved)
    model.zero_grad(set_to_none=True)
