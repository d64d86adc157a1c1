"""The degrees of parallelism, their validation, and the named DeviceMesh over them.

Ranks are laid out as ``torch.arange(world_size).view(dp)``: today the only axis is ``dp`` (data
parallel). Later layouts add axes to the same view, and every other piece of code asks the mesh for
its group (``mesh["dp"]``) instead of computing ranks itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from paratrain.errors import ConfigError

Strategy = Literal["single", "dp", "ddp"]

# Strategies whose processes each hold a full replica and read their own slice of every batch.
_PROCESS_PER_REPLICA = {"ddp"}


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel axis for a strategy at a world size."""

    strategy: Strategy
    world_size: int
    dp: int

    @classmethod
    def from_strategy(cls, strategy: Strategy, world_size: int) -> ParallelDims:
        """Raises ConfigError when the strategy cannot run on world_size processes."""
        if strategy in _PROCESS_PER_REPLICA:
            return cls(strategy, world_size, dp=world_size)
        if world_size != 1:
            raise ConfigError(
                f"parallel.strategy={strategy} runs in one process, but {world_size} were started; "
                f"use parallel.strategy=ddp for several processes, or start one"
            )
        return cls(strategy, world_size, dp=1)

    @property
    def needs_process_group(self) -> bool:
        return self.strategy in _PROCESS_PER_REPLICA

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The named mesh over all ranks, or None for single-process strategies (no group exists)."""
        if not self.needs_process_group:
            return None
        return init_device_mesh(device_type, (self.dp,), mesh_dim_names=("dp",))


def data_parallel_coordinates(mesh: DeviceMesh | None) -> tuple[int, int]:
    """(rank, size) of this process along the data-parallel axis: what the data loader needs."""
    if mesh is None:
        return 0, 1
    dp_mesh = mesh["dp"]
    return dp_mesh.get_local_rank(), dp_mesh.size()
