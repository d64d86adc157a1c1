"""Hugging Face models in one process: the factory, model.pretrained's checks and loading by name."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from paratrain.config.schema import HF_CAUSAL_LM, ModelConfig
from paratrain.errors import ConfigError
from paratrain.models.hf import _source_requirements, causal_lm, check_transformers_version, supported_range
from paratrain.models.init import build_on_meta, materialize
from paratrain.models.meta import on_meta
from paratrain.models.plan_derivation import plan_of
from paratrain.models.pretrained import check_pretrained_dir
from paratrain.parallel.pipeline.split import pipeline_sequence
from paratrain.parallel.pipeline.stages import stage_modules
from paratrain.parallel.tensor import check_tensor_parallel_plan

LLAMA = dict(
    model_type="llama",
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=8,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(3)
    model = causal_lm(**LLAMA)
    directory = tmp_path_factory.mktemp("llama")
    model.save_pretrained(directory)
    return directory, model


def test_pretrained_without_a_factory_builds_the_transformers_model_of_its_config():
    section = ModelConfig(pretrained="some/dir", args={"num_hidden_layers": 1})
    assert section.factory == HF_CAUSAL_LM
    assert section.args == {"config_dir": "some/dir", "num_hidden_layers": 1}


def test_materialize_from_pretrained_loads_every_weight_and_recomputes_rotary_frequencies(saved):
    directory, original = saved
    factory = lambda: causal_lm(config_dir=str(directory))  # noqa: E731
    model = build_on_meta(factory, seed=0)
    materialize(model, factory=factory, device=torch.device("cpu"), seed=0, pretrained=directory)

    expected = {**dict(original.named_parameters()), **dict(original.named_buffers())}
    actual = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert actual.keys() == expected.keys() and any("inv_freq" in name for name in actual)
    assert all(torch.equal(actual[name], expected[name]) for name in expected)


def test_pretrained_weights_of_another_shape_are_refused_naming_them(saved):
    directory, _ = saved
    factory = lambda: causal_lm(**{**LLAMA, "intermediate_size": 24})  # noqa: E731
    model = build_on_meta(factory, seed=0)
    with pytest.raises(
        ConfigError, match=r"model.layers.0.mlp.down_proj.weight \(files \[16, 32\], model \[16, 24\]\)"
    ):
        materialize(model, factory=factory, device=torch.device("cpu"), seed=0, pretrained=directory)


def test_pretrained_weights_without_a_parameter_of_the_model_are_refused_naming_it(saved):
    directory, _ = saved
    factory = lambda: causal_lm(**{**LLAMA, "num_hidden_layers": 2})  # noqa: E731
    model = build_on_meta(factory, seed=0)
    with pytest.raises(ConfigError, match=r"model.layers.1.\S+ \(not in the files\)"):
        materialize(model, factory=factory, device=torch.device("cpu"), seed=0, pretrained=directory)


def test_a_pretrained_directory_without_config_or_weights_is_refused_naming_the_key(tmp_path, saved):
    with pytest.raises(ConfigError, match="model.pretrained=.* is not a directory"):
        check_pretrained_dir(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="has no config.json"):
        check_pretrained_dir(tmp_path)
    (tmp_path / "config.json").write_text((saved[0] / "config.json").read_text())
    with pytest.raises(ConfigError, match="holds no model.safetensors or model.safetensors.index.json"):
        check_pretrained_dir(tmp_path)


def test_a_factory_calling_from_pretrained_trains_from_the_weights_it_loaded(saved):
    """transformers 5 refuses from_pretrained under a meta-device context, so build_on_meta builds it for real;
    4.56 with accelerate installed builds it on meta, and materialize loads it again for real (its third
    source). Either way the weights are the ones the factory loaded."""
    directory, original = saved
    transformers = pytest.importorskip("transformers")

    def factory():
        return transformers.AutoModelForCausalLM.from_pretrained(directory)

    model = build_on_meta(factory, seed=0)
    materialize(model, factory=factory, device=torch.device("cpu"), seed=0)
    assert not any(p.is_meta for p in model.parameters())
    assert torch.equal(model.lm_head.weight, original.lm_head.weight)
    assert torch.equal(model.model.embed_tokens.weight, original.model.embed_tokens.weight)


def test_causal_lm_needs_exactly_one_of_model_type_and_config_dir():
    with pytest.raises(ConfigError, match="give either model_type"):
        causal_lm()
    with pytest.raises(ConfigError, match="model.args.model_type='no-such-model'"):
        causal_lm(model_type="no-such-model")


def test_fsdp_units_of_a_transformers_model_are_its_no_split_decoder_layers():
    """Without a parallel_plan, a transformers model's blocks (FSDP units, activation checkpointing and
    compile targets) are the outermost modules of the classes it names in _no_split_modules."""
    with on_meta():
        llama = causal_lm(**{**LLAMA, "num_hidden_layers": 3})
        gpt2 = causal_lm(model_type="gpt2", vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=8)
    assert plan_of(llama).blocks == ("model.layers.0", "model.layers.1", "model.layers.2")
    assert plan_of(gpt2).blocks == ("transformer.h.0", "transformer.h.1")
    # The embedding, and the final norm with the head, are units of their own, unless the head is tied.
    assert plan_of(llama).outer_units == (("model.embed_tokens",), ("model.norm", "lm_head"))
    assert plan_of(gpt2).outer_units == ()  # GPT-2 ties lm_head to wte: the root keeps both
    assert plan_of(torch.nn.Linear(2, 2)).blocks == ()  # a plain module declares nothing


def test_tensor_parallel_plan_of_a_transformers_model_is_its_own_tp_plan_inside_its_layers():
    with on_meta():
        llama = causal_lm(**{**LLAMA, "num_attention_heads": 4, "num_key_value_heads": 2})
        gpt2 = causal_lm(model_type="gpt2", vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=8)
    plan = plan_of(llama)
    assert plan.block_tp_plan["self_attn.q_proj"] == "colwise" and plan.block_tp_plan["mlp.down_proj"] == "rowwise"
    assert plan.tp_divisible == {"model.args.num_attention_heads": 4, "model.args.num_key_value_heads": 2}
    with pytest.raises(ConfigError, match="parallel.tp=4 does not divide model.args.num_key_value_heads=2"):
        check_tensor_parallel_plan(plan, 4)
    with pytest.raises(ConfigError, match="parallel.sequence_parallel=true"):
        check_tensor_parallel_plan(plan, 2, sequence_parallel=True)
    with pytest.raises(ConfigError, match="declares no tensor-parallel plan"):  # GPT-2's Conv1D: no tp_plan
        check_tensor_parallel_plan(plan_of(gpt2), 2)
    llama.tp_plan = {**llama.tp_plan, "model.layers.*.mlp.up_proj": "grouped_gemm"}
    with pytest.raises(ConfigError, match="styles paratrain does not apply .*mlp.up_proj: grouped_gemm"):
        check_tensor_parallel_plan(plan_of(llama), 2)


# Each base model paratrain stages, with a config that exercises its masks: Mistral's one sliding window
# and Qwen2's per-layer mix of full and sliding-window layers, both narrower than the sequence.
CHAINED = {
    "llama": {},
    "mistral": {"sliding_window": 3},
    "qwen2": {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1},
    "qwen3": {"head_dim": 8},
}


@pytest.mark.parametrize("model_type", list(CHAINED))
def test_pipeline_stages_of_a_transformers_decoder_compute_exactly_its_forward(model_type):
    """Cut from the model's pp_plan into three stages, each feeding its decoder layers the rotary
    embeddings and causal mask that the base model's forward computes: the chained stages give the
    model's own logits, bit for bit."""
    torch.manual_seed(0)
    args = {**LLAMA, "num_hidden_layers": 3, "model_type": model_type, "tie_word_embeddings": False}
    model = causal_lm(**args, **CHAINED[model_type])
    plan = plan_of(model)
    assert plan.pipeline_sequence == (
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
        "model.norm",
        "lm_head",
    )
    sequence = plan.pipeline_sequence
    stages = stage_modules(model, [sequence[:2], sequence[2:4], sequence[4:]], nullcontext, plan.pipeline_layer_inputs)
    tokens = torch.randint(0, 64, (2, 8))
    hidden = tokens
    for stage in stages:
        hidden = stage(hidden)
    assert torch.equal(hidden, model(tokens).logits)


def test_transformers_models_that_cannot_be_staged_are_refused_naming_why():
    with on_meta():
        gpt2 = causal_lm(model_type="gpt2", vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=8)
        tied = causal_lm(**{**LLAMA, "model_type": "qwen2", "tie_word_embeddings": True})
    with pytest.raises(ConfigError, match="GPT2LMHeadModel cannot be cut into pipeline stages.*GPT2Model is not one"):
        pipeline_sequence(gpt2)
    with pytest.raises(
        ConfigError, match="lm_head shares its weight with model.embed_tokens.*tie_word_embeddings=false"
    ):
        pipeline_sequence(tied)


def test_a_transformers_release_outside_the_supported_range_is_refused_with_the_pip_command_that_fixes_it():
    supported = ">=4.56,!=5.0.*,<6"
    for installed in ("4.56.0", "5.1.0", "5.24.0"):
        check_transformers_version(installed, supported=supported)  # inside the range: no error
    for installed in ("4.55.4", "5.0.0", "6.0.0"):
        with pytest.raises(ConfigError) as refused:
            check_transformers_version(installed, supported=supported)
        message = str(refused.value)
        assert message == (
            f"transformers {installed} is installed, but paratrain supports transformers>=4.56,!=5.0.*,<6 "
            "(the versions its tests run): pip install 'transformers>=4.56,!=5.0.*,<6'"
        )


def test_the_supported_transformers_range_is_the_one_the_pyproject_declares():
    """Read from paratrain's installed metadata, which the pyproject writes: no second copy to drift."""
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    (declared,) = pyproject["project"]["optional-dependencies"]["hf"]
    assert declared == f"transformers{supported_range('transformers')}"
    assert declared in _source_requirements()  # what a source tree run without installing reads instead
