"""The degrees of parallelism, their validation, and the named DeviceMesh over them.

Ranks are laid out as ``torch.arange(world_size).view(pp, dp_replicate, dp_shard, tp)``: tensor
parallel innermost (neighbouring ranks share the fastest links), pipeline outermost. Every other
piece of code asks the mesh for its group (``mesh["tp"]``, ``mesh["dp_shard"]``) instead of
computing ranks itself.

The named strategies are shorthands for degrees; a degree set explicitly wins, and one degree may be
-1 to take whatever the world size leaves:

============  ====================================================
strategy      degrees when none are given
============  ====================================================
single, dp,   all 1 (one process)
model_parallel
ddp           dp_replicate = -1
fsdp          dp_shard = -1
hsdp          dp_shard = processes per node, dp_replicate = -1
              (with one of the two set, the other is -1)
tp            tp = -1
pp            pp = -1
============  ====================================================

``parallel.pp`` adds pipeline stages to ddp, fsdp, hsdp and tp: each pipeline rank runs the
strategy's data or tensor parallelism among the ranks that hold the same stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from paratrain.errors import ConfigError

Strategy = Literal["single", "dp", "model_parallel", "ddp", "fsdp", "hsdp", "tp", "pp"]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")

_ONE_PROCESS = ("single", "dp", "model_parallel")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel axis for a strategy at a world size (their product)."""

    strategy: Strategy
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @classmethod
    def resolve(
        cls,
        strategy: Strategy,
        *,
        world_size: int,
        local_world_size: int = 1,
        degrees: dict[str, int | None] | None = None,
    ) -> ParallelDims:
        """Fills the strategy's defaults, resolves -1 and checks the product.

        Args:
            degrees: Degrees the user set (``parallel.dp_shard`` etc.); None means not set.

        Raises:
            ConfigError: naming the degrees and the world size when they do not fit.
        """
        given = _given(degrees)
        chosen = {**_strategy_defaults(strategy, local_world_size, given), **given}
        _check_strategy_fits(strategy, chosen, world_size)
        return cls(strategy, **_fill(chosen, world_size))

    @property
    def dp(self) -> int:
        """Data-parallel size: how many different slices of each global batch are read at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def is_sharded(self) -> bool:
        """Whether parameters (and so gradients) are split across ranks."""
        return self.tp > 1 or self.strategy in ("fsdp", "hsdp")

    @property
    def needs_process_group(self) -> bool:
        return self.strategy not in _ONE_PROCESS

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The named 4-D mesh over all ranks, or None for one-process strategies (no group exists)."""
        if not self.needs_process_group:
            return None
        shape = tuple(getattr(self, name) for name in MESH_DIMS)
        return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)

    def describe(self) -> str:
        return " x ".join(f"{name}={getattr(self, name)}" for name in MESH_DIMS)


def data_parallel_coordinates(mesh: DeviceMesh | None) -> tuple[int, int]:
    """(rank, size) of this process along the data-parallel axes: what the data loader needs.

    Replicas and shards both read different data: rank = replicate_rank * dp_shard + shard_rank.
    """
    if mesh is None:
        return 0, 1
    replicate, shard = mesh["dp_replicate"], mesh["dp_shard"]
    rank = replicate.get_local_rank() * shard.size() + shard.get_local_rank()
    return rank, replicate.size() * shard.size()


def _strategy_defaults(strategy: Strategy, local_world_size: int, given: dict[str, int]) -> dict[str, int]:
    if strategy == "ddp":
        return {"dp_replicate": -1}
    if strategy == "fsdp":
        return {"dp_shard": -1}
    if strategy == "hsdp":
        # With one of the two set, the other fills; with neither, shard within a node.
        if "dp_replicate" in given or "dp_shard" in given:
            return {"dp_replicate": -1, "dp_shard": -1, **given}
        return {"dp_shard": local_world_size, "dp_replicate": -1}
    if strategy == "tp":
        return {"tp": -1}
    if strategy == "pp":
        return {"pp": -1}
    return {}


def _given(degrees: dict[str, int | None] | None) -> dict[str, int]:
    given = {name: value for name, value in (degrees or {}).items() if value is not None}
    for name, value in given.items():
        if value == 0 or value < -1:
            raise ConfigError(f"parallel.{name}={value}: a degree is a positive number, or -1 to fill the world size")
    return given


def _check_strategy_fits(strategy: Strategy, chosen: dict[str, int], world_size: int) -> None:
    more_than_one = {name for name, value in chosen.items() if value != 1}
    if strategy in _ONE_PROCESS and (world_size != 1 or more_than_one):
        raise ConfigError(
            f"parallel.strategy={strategy} runs in one process, but {world_size} were started"
            f"{' and ' + ', '.join(f'parallel.{n}' for n in sorted(more_than_one)) + ' set' if more_than_one else ''}; "
            f"use parallel.strategy=ddp (or fsdp, hsdp, tp) for several processes, or start one"
        )
    if strategy == "ddp" and more_than_one - {"dp_replicate", "pp"}:
        raise ConfigError(
            f"parallel.strategy=ddp replicates whole models; {', '.join(f'parallel.{n}' for n in sorted(more_than_one - {'dp_replicate', 'pp'}))} "
            f"need sharded parameters: use parallel.strategy=fsdp (with parallel.tp for fsdp + tensor parallel)"
        )
    if strategy == "pp" and more_than_one - {"pp"}:
        raise ConfigError(
            f"parallel.strategy=pp is pipeline parallel alone; to combine it with "
            f"{', '.join(f'parallel.{n}' for n in sorted(more_than_one - {'pp'}))}, use parallel.strategy=ddp "
            f"(or fsdp, hsdp, tp) and set parallel.pp"
        )
    if strategy == "tp" and (chosen.get("dp_replicate", 1) != 1 or chosen.get("dp_shard", 1) != 1):
        # Nothing would synchronise the data-parallel replicas' gradients: they would drift apart.
        raise ConfigError(
            "parallel.strategy=tp is tensor parallel alone; to add data parallel, use "
            "parallel.strategy=fsdp (or hsdp) with parallel.tp"
        )
    if strategy == "fsdp" and chosen.get("dp_replicate", 1) != 1:
        raise ConfigError(
            "parallel.strategy=fsdp shards over all data-parallel ranks; to replicate across "
            "parallel.dp_replicate groups as well, use parallel.strategy=hsdp"
        )


def _fill(chosen: dict[str, int], world_size: int) -> dict[str, int]:
    """Replaces the one -1 degree by what the world size leaves; checks the product."""
    degrees = {name: chosen.get(name, 1) for name in MESH_DIMS}
    to_fill = [name for name, value in degrees.items() if value == -1]
    if len(to_fill) > 1:
        raise ConfigError(f"only one degree may be -1, but {', '.join('parallel.' + n for n in to_fill)} are")
    known = math.prod(value for value in degrees.values() if value != -1)
    if to_fill:
        if world_size % known:
            raise ConfigError(_product_message(degrees, world_size, f"the other degrees ({known}) do not divide it"))
        degrees[to_fill[0]] = world_size // known
    elif known != world_size:
        raise ConfigError(_product_message(degrees, world_size, f"their product is {known}"))
    return degrees


def _product_message(degrees: dict[str, int], world_size: int, problem: str) -> str:
    shown = " x ".join(f"parallel.{name}={value}" for name, value in degrees.items())
    return (
        f"{shown} does not fit the world size {world_size}: {problem}; set degrees whose product is "
        f"{world_size}, or one of them to -1"
    )
