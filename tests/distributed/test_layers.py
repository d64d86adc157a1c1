"""Layer tests: paratrain's parallel pieces on four real gloo ranks (the session's pool) against an
unsharded copy on the same seed and batch, so a tensor-parallel or sharding bug fails here and not only
in a full parity run. The 8-rank mesh is built on torch's fake process group, rank by rank in this
process: building meshes needs no collectives' results, and 8 real processes would not fit two cores.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from paratrain.parallel.dims import ParallelDims
from tests.distributed import layer_checks

TOLERANCE = 1e-5


def worst(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The largest difference of each quantity over all ranks."""
    return {key: max(result[key] for result in per_rank) for key in per_rank[0]}


def far_apart(differences: dict[str, float]) -> dict[str, float]:
    return {key: value for key, value in differences.items() if not value <= TOLERANCE}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_block_matches_the_unsharded_block(ranks, sequence_parallel):
    differences = worst(ranks.run(layer_checks.tensor_parallel_block, sequence_parallel))
    assert "grad attn.q_proj.weight" in differences and "grad mlp_norm.weight" in differences
    assert far_apart(differences) == {}


@pytest.mark.parametrize(
    "sequence_parallel, plan_changes",
    [
        (True, {"block_norms": ()}),  # sequence parallel without sharding the norms
        (False, {"block_tp_plan": {"attn.q_proj": "colwise", "attn.out_proj": "rowwise"}}),  # k, v left whole
        (False, {"block_tp_plan": {"mlp.up_proj": "rowwise", "mlp.down_proj": "colwise"}}),  # styles swapped
    ],
    ids=["sp-without-norms", "missing-kv", "swapped-styles"],
)
def test_a_wrong_tensor_parallel_plan_is_caught(ranks, sequence_parallel, plan_changes):
    """The same comparison with a broken plan must fail: either DTensor refuses the layout, or some
    output or gradient differs from the unsharded block's."""
    per_rank = ranks.run(layer_checks.tensor_parallel_block_or_error, sequence_parallel, plan_changes)
    raised = [result["raised"] for result in per_rank if "raised" in result]
    assert raised or far_apart(worst(per_rank)), "a wrong plan matched the unsharded block"


@pytest.mark.parametrize(
    "degrees, options",
    [
        ({"dp_shard": 4}, {}),
        ({"dp_shard": 2, "tp": 2}, {"sequence_parallel": True}),
        ({"dp_replicate": 2, "dp_shard": 2}, {}),
    ],
    ids=["fsdp4", "fsdp2-tp2-sp", "hsdp2x2"],
)
def test_parallelize_gives_the_unsharded_gradients(ranks, degrees, options):
    differences = worst(ranks.run(layer_checks.parallelized_gpt, degrees, options))
    assert len(differences) == 1 + len(list(layer_checks.GPT(layer_checks.SMALL).parameters()))
    assert far_apart(differences) == {}


@pytest.mark.parametrize(
    "degrees",
    [{"dp_shard": 4}, {"dp_shard": 2, "tp": 2}, {"dp_replicate": 2, "tp": 2}, {"dp_replicate": 2, "dp_shard": 2}],
    ids=["fsdp4", "fsdp2-tp2", "ddp2-tp2", "hsdp2x2"],
)
def test_clipping_sharded_gradients_matches_clipping_the_unsharded_ones(ranks, degrees):
    """Sharded (fsdp), on two meshes (fsdp x tp), mixed with plain ones (tp leaves norms and the
    embedding whole), and sharded and replicated (hsdp: the copies counted once): the global norm and
    every clipped gradient equal torch's clip on the whole model."""
    per_rank = ranks.run(layer_checks.clipped_gpt_gradients, degrees, 0.05)
    assert min(result.pop("reference_norm") for result in per_rank) > 0.05, "the check must clip"
    differences = worst(per_rank)
    assert len(differences) == 1 + len(list(layer_checks.GPT(layer_checks.SMALL).parameters()))
    assert far_apart(differences) == {}


@pytest.mark.parametrize("kernel", [{"fused": True}, {"foreach": True}], ids=["fused", "foreach"])
@pytest.mark.parametrize(
    "degrees",
    [{"dp_shard": 4}, {"dp_replicate": 2, "dp_shard": 2}, {"dp_shard": 2, "tp": 2}],
    ids=["fsdp4", "hsdp2x2", "fsdp2-tp2"],
)
def test_adamw_on_the_shards_steps_exactly_as_on_the_dtensors(ranks, degrees, kernel):
    """Three steps of build_optimizer's two groups, each group step on the shards (fsdp x tp: cut on two
    meshes, gradients and moments as their parameters), give torch's AdamW on the DTensors bit for bit."""
    per_rank = ranks.run(layer_checks.adamw_on_shards_against_dtensors, degrees, kernel)
    assert all(result["unequal"] == 0 for result in per_rank), per_rank
    assert all(result["moments_are_dtensors"] for result in per_rank)
    assert all(result["on_shards"] == 2 * 3 for result in per_rank), per_rank


@pytest.mark.parametrize("degrees", [{"dp_shard": 4}, {"dp_shard": 2, "tp": 2}], ids=["fsdp4", "fsdp2-tp2"])
def test_a_healing_group_receives_shards_and_steps_as_its_live_peer(ranks, degrees):
    per_rank = ranks.run(layer_checks.healed_from_a_peers_shards, degrees)
    assert all(result["unequal"] == 0 for result in per_rank), per_rank
    assert all(result["dtensors_sent"] == 0 and result["healed_are_dtensors"] for result in per_rank), per_rank
    assert all(result["weights_alone"] for result in per_rank), per_rank


def test_fsdp_shards_a_model_without_blocks_as_one_unit(ranks):
    """What tests/integration/test_bad_input.py's warning promises: one unit, the root, all of it sharded."""
    for result in ranks.run(layer_checks.fsdp_units_of_a_model_without_blocks):
        assert result == {"units": 1, "root_is_unit": True, "all_sharded": True}


def test_role_meshes_on_four_gloo_ranks(ranks):
    views = ranks.run(layer_checks.role_mesh_groups, {"dp_replicate": 2, "tp": 2})
    # rank = dp_replicate * 2 + tp
    assert [view["groups"]["tp"] for view in views] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [view["groups"]["batch"] for view in views] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [view["groups"]["fsdp"] for view in views] == [[0, 2], [1, 3], [0, 2], [1, 3]]  # tp with replicas: hsdp
    assert [view["dp_rank"] for view in views] == [0, 0, 1, 1]
    assert {view["layout"] for view in views} == {"hsdp"}


# pp=2 x dp_replicate=1 x dp_shard=2 x tp=2: rank = pp * 4 + dp_shard * 2 + tp.
EIGHT_RANKS = {
    "tp": [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5], [6, 7], [6, 7]],
    "pp": [[0, 4], [1, 5], [2, 6], [3, 7], [0, 4], [1, 5], [2, 6], [3, 7]],
    "batch": [[0, 2], [1, 3], [0, 2], [1, 3], [4, 6], [5, 7], [4, 6], [5, 7]],
    "fsdp": [[0, 2], [1, 3], [0, 2], [1, 3], [4, 6], [5, 7], [4, 6], [5, 7]],
    "loss": [[0, 2, 4, 6], [1, 3, 5, 7]] * 4,
}


def test_role_meshes_of_a_four_dimensional_layout_on_eight_ranks():
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415 - private test module

    assert not dist.is_initialized(), "another test left a default process group in this process"
    views = []
    for rank in range(8):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        try:
            views.append(layer_checks.role_mesh_groups({"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 2}))
        finally:
            dist.destroy_process_group()
    for role, expected in EIGHT_RANKS.items():
        assert [view["groups"][role] for view in views] == expected, role
    assert [view["dp_rank"] for view in views] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [view["pp_rank"] for view in views] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert ParallelDims.resolve(None, world_size=8, degrees={"pp": 2, "dp_shard": 2, "tp": 2}).strategy == "fsdp"
