"""Models paratrain did not write: Hugging Face GPT-2 and Llama built from configs, and a plain
nn.Sequential that declares nothing, start from the same weights under every layout as under one
process and train like it."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from paratrain.data.text import build_char_dataset
from paratrain.losses import cross_entropy
from paratrain.models.hf import causal_lm
from tests.harness import (
    TINY_TEXT,
    LayoutRuns,
    checkpoint_weights,
    losses_by_step,
    max_relative_difference,
    read_metrics,
    run_cli,
    run_cli_in_process,
    tiny_config,
    write_config,
)

# The first test trains every layout below in three shared launches (1, 2 and 4 processes).
pytestmark = pytest.mark.timeout(600)

STEPS = 12
LOSS_RTOL = 1e-5

TINY_GPT2 = {
    "factory": "paratrain.models.hf:causal_lm",
    "args": {
        "model_type": "gpt2",
        "vocab_size": 128,
        "n_positions": 16,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 2,
        # Dropout draws differ between layouts; parity is about the arithmetic.
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
}
TINY_LLAMA = {
    "factory": "paratrain.models.hf:causal_lm",
    "args": {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 16,
    },
}
# Mixtures of experts, 4 experts top-2 in each of 2 layers; the load-balancing loss is in the training loss
# (coefficient raised from transformers' 0.001/0.02 so that its arithmetic shows in the parity).
TINY_QWEN3_MOE = {
    "factory": "paratrain.models.hf:causal_lm",
    "args": {
        **TINY_LLAMA["args"],
        "model_type": "qwen3_moe",
        "head_dim": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "router_aux_loss_coef": 0.1,
    },
}
TINY_MIXTRAL = {
    "factory": "paratrain.models.hf:causal_lm",
    "args": {
        **TINY_LLAMA["args"],
        "model_type": "mixtral",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.1,
    },
}
# paratrain's GPT with its MoE feed-forward; capacity 1.0 drops tokens (each forward holds 32 tokens in
# every layout, so each expert keeps the same 16 places).
TINY_GPT_MOE = {
    "factory": "paratrain.models.gpt:build_gpt",
    "args": {
        "vocab_size": 128,
        "block_size": 16,
        "n_layer": 2,
        "n_head": 2,
        "n_embd": 32,
        "moe_experts": 4,
        "moe_top_k": 2,
        "moe_aux_loss_coef": 0.1,
        "moe_capacity_factor": 1.0,
    },
}
PLAIN_MLP = [
    "model.factory=tests.integration.plain_models:build_sequential",
    "model.args={}",
    "data.factory=paratrain.data.regression:build_regression_dataset",
    "data.args={in_features: 4}",
    "loss.factory=paratrain.losses:mse",
]
LAYOUT_OVERRIDES = {
    "single": ([], 1),
    "ddp x2": (["parallel.strategy=ddp"], 2),
    "fsdp x2": (["parallel.strategy=fsdp"], 2),
    "hsdp 2x2": (["parallel.strategy=hsdp", "parallel.dp_replicate=2"], 4),
}
# Qwen2 is Llama-shaped; tied embeddings are what it adds to the export test.
TINY_QWEN2_TIED = {**TINY_LLAMA, "args": {**TINY_LLAMA["args"], "model_type": "qwen2", "tie_word_embeddings": True}}
MODELS = {"gpt2": TINY_GPT2, "llama": TINY_LLAMA}
MOE_MODELS = {"qwen3moe": TINY_QWEN3_MOE, "mixtral": TINY_MIXTRAL, "gptmoe": TINY_GPT_MOE}
# Fine-tuning: {run:pretrained} is the save_pretrained directory the fixture writes; data in file order,
# so the first global batch is the dataset's first samples.
FROM_PRETRAINED = [
    "model.factory=paratrain.models.hf:causal_lm",
    "model.args={config_dir: '{run:pretrained}'}",
    "model.pretrained={run:pretrained}",
    "data.shuffle=false",
]


def _model_overrides(section: dict) -> list[str]:
    args = ", ".join(f"{key}: {value}" for key, value in section["args"].items())
    return [f"model.factory={section['factory']}", f"model.args={{{args}}}"]


LAYOUTS = {
    **{
        f"{model} {layout}": (_model_overrides(section) + overrides, nproc)
        for model, section in MODELS.items()
        for layout, (overrides, nproc) in LAYOUT_OVERRIDES.items()
    },
    **{
        f"{model} {layout}": (_model_overrides(section) + overrides, nproc)
        for model, section in MOE_MODELS.items()
        for layout, (overrides, nproc) in LAYOUT_OVERRIDES.items()
        if not (model == "gptmoe" and layout == "hsdp 2x2")
    },
    **{
        f"mlp {layout}": (PLAIN_MLP + overrides, nproc)
        for layout, (overrides, nproc) in LAYOUT_OVERRIDES.items()
        if layout != "ddp x2"
    },
    # Tensor parallel from Llama's own tp_plan (q/k/v, gate/up colwise; o, down rowwise).
    "llama tp x2": (_model_overrides(TINY_LLAMA) + ["parallel.tp=2"], 2),
    "llama fsdp+tp 2x2": (_model_overrides(TINY_LLAMA) + ["parallel.dp_shard=2", "parallel.tp=2"], 4),
    # Stages from Llama's pp_plan, each feeding its decoder layers the rotary embeddings and causal mask.
    "llama pp x2": (_model_overrides(TINY_LLAMA) + ["parallel.strategy=pp"], 2),
    "pretrained single": (FROM_PRETRAINED, 1),
    "pretrained fsdp x2": ([*FROM_PRETRAINED, "parallel.strategy=fsdp"], 2),
    # Each rank reads only its slices of the files (get_slice); fsdp+tp's strided shards read whole tensors.
    "pretrained tp x2": ([*FROM_PRETRAINED, "parallel.tp=2"], 2),
    "pretrained fsdp+tp 2x2": ([*FROM_PRETRAINED, "parallel.dp_shard=2", "parallel.tp=2"], 4),
    "qwen2 fsdp x2": ([*_model_overrides(TINY_QWEN2_TIED), "parallel.strategy=fsdp", "train.max_steps=3"], 2),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pretrained) -> LayoutRuns:
    return LayoutRuns(
        pretrained.parent,
        LAYOUTS,
        together=tuple(LAYOUTS),
        train={"max_steps": STEPS},
        debug={"dump_initial_weights": True},
    )


CASES = [
    name for name in LAYOUTS if name.split()[0] in ("gpt2", "llama", "mlp", *MOE_MODELS) and not name.endswith("single")
]
MOE_CASES = [name for name in CASES if name.split()[0] in MOE_MODELS]
GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny Llama trained a few steps in plain PyTorch and saved with save_pretrained; returns its
    directory and its loss on the first global batch paratrain will see."""
    torch.manual_seed(1)
    model = causal_lm(**TINY_LLAMA["args"])
    dataset = build_char_dataset(**TINY_TEXT["args"])
    inputs, targets = (torch.stack(column) for column in zip(*[dataset[i] for i in range(GLOBAL_BATCH)]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss_fn = cross_entropy()
    for _ in range(3):
        optimizer.zero_grad()
        loss_fn(model(torch.flip(inputs, [1])), targets).backward()  # not the batch checked below
        optimizer.step()
    directory = tmp_path_factory.mktemp("hf") / "pretrained"
    model.save_pretrained(directory)
    with torch.no_grad():
        first_loss = loss_fn(model(inputs), targets).item()
    (directory / "first_loss.txt").write_text(repr(first_loss))
    return directory


@pytest.mark.parametrize("case", CASES)
def test_layout_starts_from_the_single_process_weights_and_trains_like_it(runs, case):
    model = case.split()[0]
    reference, laid_out = runs.get(f"{model} single"), runs.get(case)

    expected = load_file(str(reference / "initial-weights.safetensors"))
    actual = load_file(str(laid_out / "initial-weights.safetensors"))
    assert actual.keys() == expected.keys()
    # double: transformers 4.x GPT-2 also holds its causal mask as a bool buffer, which cannot be subtracted
    differences = {name: (actual[name].double() - expected[name].double()).abs().max().item() for name in expected}
    assert max(differences.values()) == 0, differences
    assert all(tensor.isfinite().all() for tensor in actual.values())

    losses = losses_by_step(laid_out)
    assert len(losses) == STEPS
    assert max_relative_difference(losses, losses_by_step(reference)) <= LOSS_RTOL


@pytest.mark.parametrize("case", [name for name in MOE_CASES if name.startswith("gptmoe")])
def test_moe_layout_logs_the_single_process_router_statistics(runs, case):
    """Each expert's tokens are summed over the data-parallel ranks: the fewest and most any expert
    computed, and the assignments dropped over capacity, are the single process's, step by step."""
    fields = ("moe_expert_tokens_min", "moe_expert_tokens_max", "moe_dropped_tokens")
    expected, actual = read_metrics(runs.get("gptmoe single")), read_metrics(runs.get(case))
    assert [[r.get(f) for f in fields] for r in actual] == [[r.get(f) for f in fields] for r in expected]
    assert all(r["moe_dropped_tokens"] > 0 for r in expected)  # capacity 1.0 drops some: the counts are tested
    aux = [r["moe_aux_loss"] for r in actual]
    assert max_relative_difference(dict(enumerate(aux)), dict(enumerate(r["moe_aux_loss"] for r in expected))) <= 1e-5


@pytest.mark.parametrize(
    "layout", ["pretrained single", "pretrained fsdp x2", "pretrained tp x2", "pretrained fsdp+tp 2x2"]
)
def test_fine_tuning_starts_from_the_saved_weights_their_plain_pytorch_loss(runs, pretrained, layout):
    expected = float((pretrained / "first_loss.txt").read_text())
    first = losses_by_step(runs.get(layout))[1]
    assert abs(first - expected) / expected <= LOSS_RTOL


@pytest.mark.parametrize("model, layout", [("gpt2", "gpt2 fsdp x2"), ("qwen2 tied", "qwen2 fsdp x2")])
def test_export_hf_loads_in_plain_transformers_with_the_trained_logits(runs, tmp_path, model, layout):
    transformers = pytest.importorskip("transformers")
    checkpoint = max((runs.get(layout) / "checkpoints").glob("step-*"), key=lambda path: int(path.name[5:]))
    result = run_cli(["export", str(checkpoint), "--hf", str(tmp_path / "hf")])
    assert result.returncode == 0, result.stderr

    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    section = TINY_GPT2 if model == "gpt2" else TINY_QWEN2_TIED
    trained = causal_lm(**section["args"])
    result = trained.load_state_dict(
        checkpoint_weights(checkpoint),
        strict=False,
    )
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys  # tied: saved once
    assert trained.lm_head.weight.data_ptr() == trained.get_input_embeddings().weight.data_ptr()
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        difference = (loaded(tokens).logits - trained(tokens).logits).abs().max().item()
    assert difference <= 1e-5


def test_export_hf_of_a_model_that_is_not_from_transformers_names_the_alternative(runs):
    checkpoint = next((runs.get("mlp fsdp x2") / "checkpoints").glob("step-*"))
    result = run_cli(["export", str(checkpoint), "--hf", str(checkpoint.parent / "hf")])
    assert result.returncode == 2 and "is not a transformers model" in result.stderr and "--out" in result.stderr


def test_save_final_hf_writes_the_finished_runs_model_for_from_pretrained(tmp_path):
    """checkpoint.save_final_hf: `paratrain train` ends by writing output_dir/hf from the last checkpoint."""
    transformers = pytest.importorskip("transformers")
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run", train={"max_steps": 2}))
    code, stderr = run_cli_in_process(
        ["train", str(config), *_model_overrides(TINY_QWEN2_TIED), "checkpoint.save_final_hf=true"]
    )
    assert code == 0, stderr
    assert "wrote step-2 as a Hugging Face model to" in stderr
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run/hf")
    checkpoint = tmp_path / "run/checkpoints/step-2"
    expected = checkpoint_weights(checkpoint)
    for name, tensor in loaded.state_dict().items():
        if name in expected:
            assert torch.equal(tensor, expected[name]), name
    assert loaded.lm_head.weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()


def test_save_final_hf_for_a_model_that_is_not_from_transformers_is_refused_before_training(tmp_path):
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run"))
    code, stderr = run_cli_in_process(["train", str(config), *PLAIN_MLP, "checkpoint.save_final_hf=true"])
    assert code == 2 and "checkpoint.save_final_hf=true: Sequential" in stderr and "--out" in stderr
    assert not (tmp_path / "run").exists()
