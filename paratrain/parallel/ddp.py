"""DistributedDataParallel over the mesh's data-parallel axis."""

from __future__ import annotations

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
    """Wraps a model already on its device; gradients are averaged over ``mesh["dp_replicate"]``."""
    # Passing bucket_cap_mb at all turns off DDP's small first bucket, so pass it only when set.
    bucket = {"bucket_cap_mb": bucket_cap_mb} if bucket_cap_mb is not None else {}
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=mesh["dp_replicate"].get_group(),
        **bucket,
        static_graph=static_graph,
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=gradient_as_bucket_view,
    )
