"""The callbacks paratrain adds by itself, before the user's: the profiler (the ``profile`` section), a
mixture of experts' router statistics and DPO's rewards in the record, each only where it applies."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from paratrain.callbacks.base import Callback
from paratrain.callbacks.profiling import maybe_profiler
from paratrain.callbacks.rewards import maybe_preference_metrics
from paratrain.callbacks.routing import maybe_router_stats
from paratrain.config.schema import ProfileConfig
from paratrain.launch.process_group import DistContext


def built_in_callbacks(
    profile: ProfileConfig, model: nn.Module, loss_fn: object, *, output_dir: Path, ctx: DistContext
) -> list[Callback]:
    """Args: model: this rank's (bare) model; output_dir: the run's (the profiler writes under its profile/)."""
    profiler = maybe_profiler(profile, directory=output_dir / "profile", rank=ctx.rank, device=ctx.device)
    return [*profiler, *maybe_router_stats(model), *maybe_preference_metrics(loss_fn)]
