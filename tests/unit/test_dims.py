from __future__ import annotations

import pytest

from paratrain.config.loading import load_config
from paratrain.errors import ConfigError
from paratrain.parallel.dims import ParallelDims, resolve_parallel_dims


def resolve(strategy, world_size, local_world_size=1, **degrees) -> ParallelDims:
    return ParallelDims.resolve(strategy, world_size=world_size, local_world_size=local_world_size, degrees=degrees)


def resolved_from_overrides(world_size: int, *overrides: str) -> ParallelDims:
    """What the trainer resolves: the config's parallel section (a file's plus overrides) at a world size."""
    config = load_config(None, list(overrides))
    return resolve_parallel_dims(config.parallel, world_size=world_size, local_world_size=world_size)


# (strategy or None, world size, degrees set) -> (layout, (pp, dp_replicate, dp_shard, tp))
RESOLUTIONS = [
    # No strategy: the degrees and the process count decide.
    (None, 1, {}, "single", (1, 1, 1, 1)),
    (None, 2, {}, "ddp", (1, 2, 1, 1)),
    (None, 4, {"dp_shard": 2, "tp": 2}, "fsdp", (1, 1, 2, 2)),
    (None, 4, {"dp_replicate": 2, "dp_shard": 2}, "hsdp", (1, 2, 2, 1)),
    (None, 4, {"pp": 2, "dp_shard": 2}, "fsdp", (2, 1, 2, 1)),
    (None, 4, {"pp": 2}, "ddp", (2, 2, 1, 1)),
    (None, 2, {"tp": 2}, "tp", (1, 1, 1, 2)),
    (None, 2, {"pp": -1}, "pp", (2, 1, 1, 1)),
    (None, 4, {"dp_replicate": 2, "tp": 2}, "hsdp", (1, 2, 1, 2)),  # DDP cannot wrap DTensors: FSDP replicates
    # Names fill what is unset.
    ("single", 1, {}, "single", (1, 1, 1, 1)),
    ("ddp", 4, {}, "ddp", (1, 4, 1, 1)),
    ("fsdp", 4, {}, "fsdp", (1, 1, 4, 1)),
    ("fsdp", 4, {"tp": 2}, "fsdp", (1, 1, 2, 2)),
    ("hsdp", 4, {"dp_replicate": 2}, "hsdp", (1, 2, 2, 1)),
    ("hsdp", 8, {}, "hsdp", (1, 2, 4, 1)),  # 4 processes per node: shard within the node, replicate across
    ("tp", 2, {}, "tp", (1, 1, 1, 2)),
    ("pp", 4, {}, "pp", (4, 1, 1, 1)),
    ("ddp", 4, {"pp": 2}, "ddp", (2, 2, 1, 1)),
    ("fsdp", 8, {"pp": 2, "tp": 2}, "fsdp", (2, 1, 2, 2)),
    ("tp", 4, {"pp": 2}, "tp", (2, 1, 1, 2)),
    # Explicit degrees win over the name's defaults.
    ("ddp", 4, {"dp_shard": 2, "tp": 2}, "fsdp", (1, 1, 2, 2)),
    ("ddp", 4, {"dp_shard": 2}, "hsdp", (1, 2, 2, 1)),
    ("fsdp", 4, {"dp_replicate": 2}, "hsdp", (1, 2, 2, 1)),
    ("tp", 4, {"dp_shard": 2}, "fsdp", (1, 1, 2, 2)),
    ("pp", 4, {"dp_replicate": 2}, "ddp", (2, 2, 1, 1)),
    ("ddp", 4, {"pp": 2, "dp_shard": 2}, "fsdp", (2, 1, 2, 1)),
    ("fsdp", 4, {"tp": -1, "dp_shard": 2}, "fsdp", (1, 1, 2, 2)),  # the user's -1 fills, not the name's
    # Named layouts at one process keep their mechanism over a group of one.
    ("ddp", 1, {}, "ddp", (1, 1, 1, 1)),
    ("fsdp", 1, {}, "fsdp", (1, 1, 1, 1)),
]


@pytest.mark.parametrize("strategy,world,degrees,layout,expected", RESOLUTIONS)
def test_degrees_decide_the_layout_and_a_strategy_only_fills_unset_degrees(strategy, world, degrees, layout, expected):
    dims = resolve(strategy, world, local_world_size=4, **degrees)
    assert (dims.strategy, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp)) == (layout, expected)
    assert dims.world_size == world


def test_a_config_without_parallel_section_is_single_alone_and_ddp_with_more_processes():
    assert resolved_from_overrides(1).describe_layout() == "single: one process"
    assert resolved_from_overrides(2).describe_layout() == "ddp: dp_replicate=2"
    assert not resolved_from_overrides(1).needs_process_group


def test_a_file_naming_ddp_with_degrees_on_the_command_line_runs_the_degrees():
    dims = resolved_from_overrides(4, "parallel.strategy=ddp", "parallel.dp_replicate=2", "parallel.dp_shard=2")
    assert dims.describe_layout() == "hsdp: dp_replicate=2 x dp_shard=2"
    assert dims.fsdp_enabled and not dims.ddp_enabled


def test_roles_follow_the_resolved_layout():
    assert resolve(None, 4, dp_shard=2, tp=2).is_sharded
    assert resolve(None, 2).ddp_enabled and not resolve(None, 2).is_sharded
    assert resolve(None, 4, pp=2).pp_enabled and resolve(None, 4, pp=2).ddp_enabled
    assert resolve("dp", 1).dataparallel_enabled and not resolve("dp", 1).needs_process_group
    assert resolve("model_parallel", 1).model_parallel_enabled


def test_data_parallel_size_counts_replicas_and_shards():
    assert resolve("hsdp", 8, dp_replicate=2).dp == 8
    assert resolve("fsdp", 8, tp=2).dp == 4


@pytest.mark.parametrize(
    "strategy,world,degrees,message",
    [
        ("fsdp", 4, {"dp_shard": 3}, "does not fit the world size 4"),
        ("fsdp", 6, {"tp": 4}, "do not divide it"),
        ("fsdp", 4, {"tp": -1, "dp_shard": -1}, "only one degree may be -1"),
        ("single", 2, {}, "runs in one process"),
        ("ddp", 6, {"pp": 4}, "do not divide it"),
        ("model_parallel", 2, {}, "runs in one process"),
        ("fsdp", 2, {"tp": 0}, "a degree is a positive number"),
        (None, 4, {"tp": 3}, "do not divide it"),
    ],
)
def test_degrees_that_cannot_work_are_refused_with_the_fix(strategy, world, degrees, message):
    with pytest.raises(ConfigError, match=message):
        resolve(strategy, world, **degrees)


@pytest.mark.parametrize(
    "strategy,degree",
    [("tp", "tp"), ("fsdp", "dp_shard"), ("pp", "pp")],
)
def test_a_name_whose_own_degree_is_set_to_one_is_a_contradiction_shown_with_the_resolved_degrees(strategy, degree):
    with pytest.raises(ConfigError) as refused:
        resolved_from_overrides(2, f"parallel.strategy={strategy}", f"parallel.{degree}=1")
    message = str(refused.value)
    assert f"parallel.strategy={strategy} contradicts parallel.{degree}=1 at world size 2" in message
    assert "without the name the degrees resolve to ddp: dp_replicate=2" in message
    assert "Remove parallel.strategy" in message


@pytest.mark.parametrize(
    ("degrees", "ep", "efsdp"),
    [
        ({"dp_shard": 4, "ep": 2}, 2, 2),
        ({"dp_shard": 4, "ep": -1}, 4, 1),
        ({"dp_shard": 2, "cp": 2, "ep": 4}, 4, 1),
        ({"dp_replicate": 2, "dp_shard": 2, "ep": 2}, 2, 1),
    ],
)
def test_expert_parallel_borrows_the_sharded_data_parallel_ranks_without_changing_the_world(degrees, ep, efsdp):
    dims = ParallelDims.resolve(None, world_size=4, degrees=degrees)
    assert (dims.ep, dims.efsdp, dims.strategy) == (ep, efsdp, "hsdp" if "dp_replicate" in degrees else "fsdp")
    assert dims.world_size == 4
    assert dims.describe().endswith(f", ep={ep} (experts over ep ranks of dp_shard x cp)")


def test_expert_parallel_that_does_not_divide_the_sharded_ranks_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"parallel.ep=3 does not divide parallel.dp_shard=4 x parallel.cp=1 = 4"):
        ParallelDims.resolve(None, world_size=4, degrees={"dp_shard": 4, "ep": 3})
    with pytest.raises(ConfigError, match=r"parallel.strategy=single runs in one process.*parallel.ep"):
        ParallelDims.resolve("single", world_size=1, degrees={"ep": 2})


def test_replica_groups_are_the_outermost_data_parallel_degree_outside_the_jobs_world():
    overrides = ("parallel.dp_shard=2", "parallel.fault_tolerance.replica_groups=3")
    dims = resolved_from_overrides(2, *overrides, "parallel.fault_tolerance.replica_group=2")
    # The job is one group of 2 processes; the data is read by 3 groups x 2 shards.
    assert (dims.world_size, dims.group_dp, dims.dp, dims.loss_ranks) == (2, 2, 6, 2)
    assert dims.dp_rank == 4  # group 2's first rank (no mesh here: its place in the group is 0)
    assert dims.describe_layout() == "fsdp: dp_shard=2, replica group 2 of 3 (torchft)"
    assert not resolved_from_overrides(2, "parallel.dp_shard=2").ft_enabled


@pytest.mark.parametrize(
    "overrides, named",
    [
        (("parallel.fault_tolerance.replica_groups=2", "parallel.fault_tolerance.replica_group=2"), "between 0 and 1"),
        (("parallel.fault_tolerance.replica_groups=2",), "replica_group=None"),
        (("parallel.fault_tolerance.replica_group=0",), "at least 2 replica groups"),
        (
            ("parallel.fault_tolerance.replica_groups=2", "parallel.fault_tolerance.replica_group=0", "parallel.pp=2"),
            "parallel.pp=1",
        ),
    ],
)
def test_replica_groups_that_cannot_train_are_refused_naming_the_key(overrides, named):
    with pytest.raises(ConfigError, match="parallel.fault_tolerance") as refused:
        resolved_from_overrides(2, *overrides)
    assert named in str(refused.value)
