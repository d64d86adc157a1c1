"""Inspection aids that are off by default: full gradients or initial weights written to disk."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.models.weights import canonical_name
from paratrain.tensors import plain_tensor

if TYPE_CHECKING:
    from paratrain.config.schema import DebugConfig


def dump_gradients(
    model: nn.Module, path: Path, *, is_main: bool, pipeline_group: dist.ProcessGroup | None = None
) -> None:
    """Gathers every gradient to full size (a collective: every rank calls this) and writes them
    from rank 0, keyed by the model's own parameter names."""
    gradients = {
        name: param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        for name, param in model.named_parameters()
        if param.grad is not None
    }
    _write_gathered(gradients, path, is_main=is_main, pipeline_group=pipeline_group, dtype=torch.float32)


def maybe_dump_gradients(
    model: nn.Module,
    debug: DebugConfig,
    output_dir: Path,
    *,
    step: int,
    is_main: bool,
    pipeline_group: dist.ProcessGroup | None = None,
) -> None:
    """``dump_gradients`` to ``output_dir/gradients/step-<step>.safetensors`` when ``step`` is one of
    ``debug.dump_gradients_at_steps``; every rank calls it."""
    if step in debug.dump_gradients_at_steps:
        path = output_dir / "gradients" / f"step-{step}.safetensors"
        dump_gradients(model, path, is_main=is_main, pipeline_group=pipeline_group)


def dump_weights(
    model: nn.Module, path: Path, *, is_main: bool, pipeline_group: dist.ProcessGroup | None = None
) -> None:
    """Gathers every parameter and buffer to full size (a collective: every rank calls this) and
    writes them from rank 0 under the model's own names: the initial weights of two layouts compare
    tensor by tensor."""
    weights = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        tensor = plain_tensor(tensor)  # float8's wrapped weights: their plain values (safetensors writes no subclass)
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # every rank: one at a time
        if is_main or pipeline_group is not None:
            weights[name] = full.detach().cpu()  # only rank 0 (and the stages' ranks, to send theirs) keeps them
    _write_gathered(weights, path, is_main=is_main, pipeline_group=pipeline_group)


def _write_gathered(
    tensors: dict[str, torch.Tensor],
    path: Path,
    *,
    is_main: bool,
    pipeline_group: dist.ProcessGroup | None,
    dtype: torch.dtype | None = None,
) -> None:
    """Writes full tensors from rank 0; under a pipeline, each stage rank's tensors are gathered to it
    first (every rank of the pipeline group sends its own pieces')."""
    local = {canonical_name(name): tensor.detach().to("cpu", dtype).contiguous() for name, tensor in tensors.items()}
    if pipeline_group is not None:
        # A debugging aid between this run's own ranks: objects are fine here, speed is not the point.
        pieces: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size(pipeline_group))]
        dist.all_gather_object(pieces, local, group=pipeline_group)
        local = {name: tensor for piece in pieces for name, tensor in piece.items()}
    if is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(local, str(path))
