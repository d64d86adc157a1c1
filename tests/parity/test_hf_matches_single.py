"""Models paratrain did not write: Hugging Face GPT-2 and Llama built from configs, and a plain
nn.Sequential that declares nothing, start from the same weights under every layout as under one
process and train like it (issue 12)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.harness import LayoutRuns, losses_by_step, max_relative_difference

STEPS = 20
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
MODELS = {"gpt2": TINY_GPT2, "llama": TINY_LLAMA}


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
        f"mlp {layout}": (PLAIN_MLP + overrides, nproc)
        for layout, (overrides, nproc) in LAYOUT_OVERRIDES.items()
        if layout != "ddp x2"
    },
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> LayoutRuns:
    return LayoutRuns(
        tmp_path_factory.mktemp("hf"),
        LAYOUTS,
        together=tuple(LAYOUTS),
        train={"max_steps": STEPS},
        debug={"dump_initial_weights": True},
    )


CASES = [name for name in LAYOUTS if not name.endswith("single")]


@pytest.mark.parametrize("case", CASES)
def test_layout_starts_from_the_single_process_weights_and_trains_like_it(runs, case):
    model = case.split()[0]
    reference, laid_out = runs.get(f"{model} single"), runs.get(case)

    expected = load_file(str(reference / "initial-weights.safetensors"))
    actual = load_file(str(laid_out / "initial-weights.safetensors"))
    assert actual.keys() == expected.keys()
    differences = {name: (actual[name] - expected[name]).abs().max().item() for name in expected}
    assert max(differences.values()) == 0, differences
    assert all(tensor.isfinite().all() for tensor in actual.values())

    losses = losses_by_step(laid_out)
    assert len(losses) == STEPS
    assert max_relative_difference(losses, losses_by_step(reference)) <= LOSS_RTOL
