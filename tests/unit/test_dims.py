from __future__ import annotations

import pytest

from paratrain.errors import ConfigError
from paratrain.parallel.dims import ParallelDims


def resolve(strategy, world_size, local_world_size=1, **degrees) -> ParallelDims:
    return ParallelDims.resolve(strategy, world_size=world_size, local_world_size=local_world_size, degrees=degrees)


@pytest.mark.parametrize(
    "strategy,world,degrees,expected",
    [
        ("single", 1, {}, (1, 1, 1, 1)),
        ("ddp", 4, {}, (1, 4, 1, 1)),
        ("fsdp", 4, {}, (1, 1, 4, 1)),
        ("fsdp", 4, {"tp": 2}, (1, 1, 2, 2)),
        ("hsdp", 4, {"dp_replicate": 2}, (1, 2, 2, 1)),
        ("hsdp", 8, {}, (1, 2, 4, 1)),  # 4 processes per node: shard within the node, replicate across
        ("tp", 2, {}, (1, 1, 1, 2)),
        ("pp", 4, {}, (4, 1, 1, 1)),
        ("ddp", 4, {"pp": 2}, (2, 2, 1, 1)),
        ("fsdp", 8, {"pp": 2, "tp": 2}, (2, 1, 2, 2)),
        ("tp", 4, {"pp": 2}, (2, 1, 1, 2)),
    ],
)
def test_strategies_are_shorthands_for_degrees(strategy, world, degrees, expected):
    dims = resolve(strategy, world, local_world_size=4, **degrees)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == expected
    assert dims.world_size == world


def test_data_parallel_size_counts_replicas_and_shards():
    assert resolve("hsdp", 8, dp_replicate=2).dp == 8
    assert resolve("fsdp", 8, tp=2).dp == 4


@pytest.mark.parametrize(
    "strategy,world,degrees,message",
    [
        ("fsdp", 4, {"dp_shard": 3}, "does not fit the world size 4"),
        ("fsdp", 6, {"tp": 4}, "do not divide it"),
        ("fsdp", 4, {"tp": -1}, "only one degree may be -1"),
        ("fsdp", 4, {"dp_replicate": 2}, "use parallel.strategy=hsdp"),
        ("ddp", 4, {"tp": 2}, "use parallel.strategy=fsdp"),
        ("single", 2, {}, "runs in one process"),
        ("ddp", 6, {"pp": 4}, "do not divide it"),
        ("pp", 4, {"dp_replicate": 2}, "use parallel.strategy=ddp"),
        ("model_parallel", 2, {}, "runs in one process"),
        ("fsdp", 2, {"tp": 0}, "a degree is a positive number"),
        ("tp", 4, {"dp_shard": 2}, "with parallel.tp"),
    ],
)
def test_degrees_that_cannot_work_are_refused_with_the_fix(strategy, world, degrees, message):
    with pytest.raises(ConfigError, match=message):
        resolve(strategy, world, **degrees)
