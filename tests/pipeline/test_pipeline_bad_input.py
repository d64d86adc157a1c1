"""Pipeline settings that cannot run are refused by preflight, naming the key and the fix."""

from __future__ import annotations

import pytest

from paratrain.checks.preflight import preflight
from paratrain.config.loading import load_config
from paratrain.errors import ConfigError
from tests.harness import tiny_config, write_config

CASES = {
    "more stages than layers": (
        4,
        ["parallel.strategy=pp", "pipeline.schedule=Interleaved1F1B"],
        ["needs 8 stages", "only 5 pieces", "embed, blocks.0, blocks.1, final_norm, lm_head"],
    ),
    "batch that does not split into the micro-batches": (
        2,
        ["parallel.strategy=pp", "pipeline.microbatches=3"],
        ["train.global_batch_size=8", "pipeline.microbatches=3"],
    ),
    "ZBV without exactly 2 stages per rank": (
        2,
        ["parallel.strategy=pp", "pipeline.schedule=ZBVZeroBubble", "pipeline.stages_per_rank=3"],
        ["ZBVZeroBubble needs exactly 2 stages per rank", "pipeline.stages_per_rank=2"],
    ),
    "DualPipeV without exactly 2 stages per rank": (
        2,
        ["parallel.strategy=pp", "pipeline.schedule=DualPipeV", "pipeline.stages_per_rank=1"],
        ["DualPipeV needs exactly 2 stages per rank"],
    ),
    "split point naming a module that does not exist": (
        2,
        ["parallel.strategy=pp", "pipeline.split_points=[blocks.7]"],
        ["pipeline.split_points", "no module 'blocks.7'", "blocks"],
    ),
    "split point inside a piece": (
        2,
        ["parallel.strategy=pp", "pipeline.split_points=[blocks.0.attn]"],
        ["'blocks.0.attn' is a module of the model but not a place a stage can end", "embed, blocks.0"],
    ),
    "split points for another number of stages": (
        2,
        ["parallel.strategy=pp", "pipeline.split_points=[embed, blocks.0]"],
        ["makes 3 stages", "has 2", "name 1 split points"],
    ),
    "pipeline degree that does not divide the world size": (
        6,
        ["parallel.strategy=ddp", "parallel.pp=4"],
        ["parallel.pp=4", "does not fit the world size 6"],
    ),
    "fewer micro-batches than 1F1B stages": (
        4,
        ["parallel.strategy=pp", "train.micro_batch_size=4"],
        ["pipeline.schedule=1F1B cannot run", "pipeline.microbatches=2"],
    ),
    "multi-stage schedule with one stage per rank": (
        2,
        ["parallel.strategy=pp", "pipeline.schedule=Interleaved1F1B", "pipeline.stages_per_rank=1"],
        ["Interleaved1F1B runs several stages per rank", "set it to 2 or more"],
    ),
    "fp16": (2, ["parallel.strategy=pp", "precision=fp16"], ["precision=fp16 with pipeline parallel", "bf16"]),
    "model_parallel device that does not exist": (
        1,
        ["parallel.strategy=model_parallel", "pipeline.devices=[cuda:7]"],
        ["pipeline.devices: cuda:7 does not exist"],
    ),
    "ddp static graph": (
        4,
        ["parallel.strategy=ddp", "parallel.pp=2", "parallel.ddp.static_graph=true"],
        ["parallel.ddp.static_graph=true with parallel.pp gives wrong gradients"],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_pipeline_setting_is_refused_before_training(tmp_path, case):
    world_size, overrides, expected = CASES[case]
    path = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run"))
    with pytest.raises(ConfigError) as error:
        preflight(load_config(path, overrides), world_size=world_size, nproc_per_node=world_size)
    for text in expected:
        assert text in str(error.value), f"{text!r} not in: {error.value}"


def test_model_without_a_pipeline_sequence_is_told_how_to_declare_one(tmp_path):
    path = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run"))
    config = load_config(
        path, ["parallel.strategy=pp", "model.factory=tests.integration.plain_models:build_two_layers", "model.args={}"]
    )
    with pytest.raises(ConfigError, match="declares no pipeline sequence.*pipeline_sequence"):
        preflight(config, world_size=2, nproc_per_node=2)


def test_a_transformers_model_that_cannot_be_staged_is_refused_before_training_naming_why(tmp_path):
    pytest.importorskip("transformers")
    path = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run"))
    gpt2 = "{model_type: gpt2, vocab_size: 128, n_positions: 16, n_embd: 32, n_layer: 2, n_head: 2}"
    config = load_config(
        path, ["parallel.strategy=pp", "model.factory=paratrain.models.hf:causal_lm", f"model.args={gpt2}"]
    )
    with pytest.raises(ConfigError, match="GPT2LMHeadModel cannot be cut into pipeline stages.*fsdp, hsdp, ddp or tp"):
        preflight(config, world_size=2, nproc_per_node=2)
