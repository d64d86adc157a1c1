"""A run's config made ready to train, the same way for both entries (``paratrain train`` before it launches,
``python -m paratrain.train`` on each rank under the user's own torchrun): load it, let the planner choose
``parallel.strategy: auto``'s layout, check everything at once, resolve the degrees, and list the options
that have no effect."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from paratrain.checks.preflight import preflight
from paratrain.checks.warnings import ineffective_options
from paratrain.config.loading import load_config
from paratrain.config.schema import Config
from paratrain.parallel.dims import ParallelDims, resolve_parallel_dims
from paratrain.planner.memory_check import describe_auto_choice, maybe_resolve_auto


@dataclass(frozen=True)
class PreparedRun:
    """A config ready to train on a world of processes.

    Attributes:
        config: Every degree explicit (``auto`` replaced by the planner's choice).
        dims: Its degrees on this world; None when the checks were left to another process.
        auto_choice: What ``auto`` chose, as a line to show the user; None without ``auto``.
        warnings: Options set explicitly that the rest of the config makes irrelevant.
    """

    config: Config
    dims: ParallelDims | None = None
    auto_choice: str | None = None
    warnings: list[str] = field(default_factory=list)


def prepare_run(
    config_path: str | Path, overrides: list[str], *, world_size: int, nproc_per_node: int, check: bool = True
) -> PreparedRun:
    """Loads the config and, with ``check``, runs the preflight (every problem at once, ConfigError) and
    resolves its degrees.

    Args:
        check: False where another process already checked the same config (the launcher before its
            workers, or rank 0 for the other ranks): the layout is still resolved, the same on every rank.
    """
    config = load_config(config_path, overrides)
    auto = config.parallel.strategy == "auto"
    # Deterministic on every rank (ranked against total memory): every rank resolves auto to the same layout.
    config = maybe_resolve_auto(config, world_size=world_size, nproc_per_node=nproc_per_node)
    if not check:
        return PreparedRun(config)
    preflight(config, world_size=world_size, nproc_per_node=nproc_per_node)
    dims = resolve_parallel_dims(config.parallel, world_size=world_size, local_world_size=nproc_per_node)
    choice = describe_auto_choice(dims) if auto else None
    return PreparedRun(config, dims, choice, ineffective_options(config, dims))
