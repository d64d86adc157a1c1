from __future__ import annotations

import pytest

from paratrain.config.loading import config_to_yaml, flatten_dotted, load_config
from paratrain.config.schema import Config
from paratrain.errors import ConfigError


def test_overrides_beat_the_file_which_beats_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  max_steps: 7\n  seed: 3\n")
    config = load_config(path, ["train.seed=11", "optim.betas=[0.8, 0.9]"])
    assert config.train.max_steps == 7
    assert config.train.seed == 11
    assert config.optim.betas == (0.8, 0.9)
    assert config.optim.lr == Config().optim.lr


def test_resolved_yaml_reads_back_to_the_same_config(tmp_path):
    config = load_config(None, ["model.args.n_layer=3", "checkpoint.keep_last=null", "precision=bf16"])
    path = tmp_path / "resolved.yaml"
    path.write_text(config_to_yaml(config))
    assert load_config(path) == config


def test_unknown_nested_key_is_reported_with_its_dotted_path():
    with pytest.raises(ConfigError, match=r"parallel\.ddp\.bucket_size: unknown key"):
        load_config(None, ["parallel.ddp.bucket_size=10"])


def test_global_batch_must_divide_by_micro_batch():
    with pytest.raises(ConfigError, match="train.global_batch_size=10 is not divisible by train.micro_batch_size=4"):
        load_config(None, ["train.global_batch_size=10", "train.micro_batch_size=4"])


@pytest.mark.parametrize("override", ["train.max_steps", "=3", "train..seed=1"])
def test_malformed_override_is_explained(override):
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_config(None, [override])


def test_override_cannot_descend_into_a_value(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("precision: bf16\n")
    with pytest.raises(ConfigError, match="precision is a value, not a section"):
        load_config(path, ["precision.dtype=bf16"])


def test_top_level_yaml_must_be_a_mapping(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(path)


def warnings_at(world_size: int, *overrides: str) -> list[str]:
    from paratrain.checks.warnings import ineffective_options
    from paratrain.parallel.dims import resolve_parallel_dims

    config = load_config(None, list(overrides))
    return ineffective_options(config, resolve_parallel_dims(config.parallel, world_size=world_size))


def test_options_without_effect_are_warned_about_only_when_set():
    assert warnings_at(1) == []
    assert warnings_at(1, "parallel.ddp.static_graph=true", "optim.momentum=0.9") == [
        "parallel.ddp.static_graph has no effect with the single: one process layout (ddp only)",
        "optim.momentum has no effect with optim.name=adamw (it is an SGD option)",
    ]
    assert warnings_at(2, "parallel.ddp.static_graph=true") == []  # no parallel section, 2 processes: DDP


def test_pipeline_options_outside_a_pipeline_are_flagged():
    assert warnings_at(1, "pipeline.schedule=GPipe") == [
        "pipeline.schedule has no effect without a pipeline (parallel.pp > 1, or parallel.strategy=model_parallel)"
    ]
    assert warnings_at(2, "parallel.strategy=pp", "pipeline.devices=[cpu]") == [
        "pipeline.devices has no effect with parallel.pp (each rank uses its own device); it is for model_parallel"
    ]
    assert warnings_at(2, "parallel.pp=2", "pipeline.schedule=GPipe") == []


def test_checkpointing_and_float8_options_without_effect_are_flagged():
    assert warnings_at(1, "parallel.activation_checkpointing_every=2") == [
        "parallel.activation_checkpointing_every has no effect with parallel.activation_checkpointing=none"
    ]
    assert warnings_at(1, "parallel.float8.scaling=rowwise") == [
        "parallel.float8.scaling has no effect without parallel.float8.enabled=true"
    ]
    float8 = ["parallel.float8.enabled=true", "parallel.compile=true", "parallel.float8.fsdp_float8_all_gather=true"]
    assert warnings_at(2, "parallel.strategy=fsdp", *float8) == []
    assert warnings_at(2, "parallel.dp_shard=1", "parallel.tp=2", *float8) == [
        "parallel.float8.fsdp_float8_all_gather has no effect with scaling=tensorwise and the tp: tp=2 layout "
        "(tensorwise scaling under fsdp or hsdp, without tp, only)"
    ]
    assert warnings_at(1, "parallel.float8.enabled=true") == [
        "parallel.float8 without parallel.compile: each float8 cast and scale runs as kernels of its own, which "
        "usually leaves float8 slower than bf16; set parallel.compile=true"
    ]


def test_activation_checkpointing_of_older_configs_reads_true_as_full_and_false_as_none(tmp_path):
    assert load_config(None, ["parallel.activation_checkpointing=true"]).parallel.activation_checkpointing == "full"
    assert load_config(None, ["parallel.activation_checkpointing=false"]).parallel.activation_checkpointing == "none"
    path = tmp_path / "old.yaml"
    path.write_text("parallel:\n  activation_checkpointing: true\n")
    assert load_config(path).parallel.activation_checkpointing == "full"


def test_progress_bar_on_and_off_survive_yaml_reading_them_as_booleans():
    assert load_config(None, ["log.progress_bar=off"]).log.progress_bar == "off"
    assert load_config(None, ["log.progress_bar=on"]).log.progress_bar == "on"


@pytest.mark.parametrize("factory", [{}, {"factory": "paratrain.models.hf:causal_lm"}])
def test_pretrained_builds_the_transformers_model_from_its_directory_with_or_without_the_factory(factory):
    # examples/hf_llama.yaml: "Fine-tune instead: replace model.args by pretrained: DIR", factory kept.
    config = Config.model_validate({"model": {**factory, "pretrained": "pretrained/llama"}})
    assert config.model.factory == "paratrain.models.hf:causal_lm"
    assert config.model.args == {"config_dir": "pretrained/llama"}


def test_pretrained_args_override_its_config_fields_and_other_factories_keep_their_args():
    config = Config.model_validate({"model": {"pretrained": "weights", "args": {"n_layer": 2}}})
    assert config.model.factory == "paratrain.models.hf:causal_lm"
    assert config.model.args == {"config_dir": "weights", "n_layer": 2}
    gpt = Config.model_validate({"model": {"factory": "paratrain.models.gpt:build_gpt", "pretrained": "w"}})
    assert gpt.model.args == {}


def test_flatten_dotted_gives_override_keys_and_drops_empty_sections():
    tree = {"optim": {"lr": 0.1, "betas": [0.9, 0.95]}, "model": {"args": {}}, "run": {"output_dir": "runs/x"}}
    assert flatten_dotted(tree) == {"optim.lr": 0.1, "optim.betas": [0.9, 0.95], "run.output_dir": "runs/x"}
