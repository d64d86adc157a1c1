"""Expert parallel for transformers' MoE families (Qwen3-MoE, Mixtral, Qwen2-MoE with its shared expert,
DeepSeek-V3 with shared experts, grouped routing and a dense first layer) trains like one process: ep x2,
ep x2 beside FSDP over the ranks ep leaves (dp_shard=4), and tensor parallel (attention split, experts whole
per tp rank) x2, against one process on the same seed and batch: every step's loss, the step-1 gradients,
the tokens each expert computed and the family's own load-balancing loss; under context parallel x2 (each
rank half of every sequence) the load-balancing loss too, from statistics over whole sequences; and
DeepSeek-V3 balanced by its router bias (moe_balance: bias) under ep x2. A save_pretrained Qwen3-MoE loads
sliced under ep x2 from its files and exports back in transformers' layout; LoRA on its attention trains under
fsdp x2 and ep x2, and LoRA on its stacked experts (peft's target_parameters) under fsdp x2, each adapter
exported as peft loads it.

Every layout of a process count trains in one launch (tests/harness.LayoutRuns)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from paratrain.data.text import build_char_dataset
from paratrain.losses import cross_entropy
from paratrain.models.hf import causal_lm
from tests.harness import (
    TINY_TEXT,
    LayoutRuns,
    assert_matches_single_process,
    checkpoint_weights,
    losses_by_step,
    max_relative_difference,
    read_metrics,
    run_cli,
)

# transformers 4.x keeps each expert as its own module, which expert parallel refuses (tests/unit/test_hf_experts.py).
pytest.importorskip("transformers", minversion="5")
pytestmark = pytest.mark.timeout(900)

STEPS = 10
LOSS_RTOL = 1e-5
COMMON = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16,
    "num_experts_per_tok": 2,
}
# 4 experts top-2 per MoE layer; the load-balancing coefficient raised from transformers' 0.001 so that its
# arithmetic shows in the parity.
FAMILIES = {
    "qwen3_moe": {"head_dim": 8, "num_experts": 4, "moe_intermediate_size": 32, "router_aux_loss_coef": 0.1},
    "mixtral": {"num_local_experts": 4, "router_aux_loss_coef": 0.1},
    "qwen2_moe": {
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "router_aux_loss_coef": 0.1,
    },
    # Multi-head latent attention (as many key/value heads as query heads); 2 groups of 2 experts, each token's
    # top 2 from its best group; layer 0 dense. No aux loss: its router's bias balances instead.
    "deepseek_v3": {
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "moe_intermediate_size": 32,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": None,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
    },
}
EP2 = ["parallel.dp_shard=2", "parallel.ep=2"]
EP2_FSDP4 = ["parallel.dp_shard=4", "parallel.ep=2"]
TP2 = ["parallel.tp=2"]
BIAS = ["model.args.moe_balance=bias", "model.args.moe_bias_update_rate=0.01"]
LORA = "model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj]}"
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# LoRA on the stacked experts themselves (peft's target_parameters: one rank-4 adapter per expert) and attention.
LORA_EXPERTS = f"model.lora={{r: 4, alpha: 8, target_modules: [q_proj, v_proj], target_parameters: [{', '.join(EXPERT_PARAMETERS)}]}}"


def model_args(family: str) -> dict:
    return {**COMMON, "model_type": family, **FAMILIES[family]}


def _model(family: str) -> list[str]:
    args = ", ".join(f"{key}: {'null' if value is None else value}" for key, value in model_args(family).items())
    return ["model.factory=paratrain.models.hf:causal_lm", f"model.args={{{args}}}"]


FROM_PRETRAINED = [
    "model.factory=paratrain.models.hf:causal_lm",
    "model.args={config_dir: '{run:pretrained}'}",
    "model.pretrained={run:pretrained}",
    "data.shuffle=false",
]
LAYOUTS = {
    **{f"{family} single": (_model(family), 1) for family in FAMILIES},
    **{f"{family} ep x2": (_model(family) + EP2, 2) for family in FAMILIES},
    **{f"{family} tp x2": (_model(family) + TP2, 2) for family in FAMILIES},
    **{f"{family} ep x2 fsdp x4": (_model(family) + EP2_FSDP4, 4) for family in FAMILIES},
    # Aux-loss-free balancing: DeepSeek-V3's router bias moved after every step from the counts of every rank.
    "deepseek_v3_bias single": (_model("deepseek_v3") + BIAS, 1),
    "deepseek_v3_bias ep x2": (_model("deepseek_v3") + BIAS + EP2, 2),
    # Each rank holds half of every sequence: the load-balancing loss from both halves' statistics.
    **{f"{family} cp x2": (_model(family) + ["parallel.cp=2"], 2) for family in FAMILIES},
    "qwen3_moe ep x4": (_model("qwen3_moe") + ["parallel.dp_shard=4", "parallel.ep=4"], 4),
    "qwen3_moe ep x2 tp x2": (_model("qwen3_moe") + EP2 + TP2, 4),
    "pretrained ep x2": (FROM_PRETRAINED + EP2, 2),
    # LoRA on the attention of the saved Qwen3-MoE, its experts (and everything else) frozen.
    "lora single": (FROM_PRETRAINED + [LORA], 1),
    "lora fsdp x2": (FROM_PRETRAINED + [LORA, "parallel.dp_shard=2"], 2),
    "lora ep x2": (FROM_PRETRAINED + [LORA] + EP2, 2),
    "lora_experts single": (FROM_PRETRAINED + [LORA_EXPERTS], 1),
    "lora_experts fsdp x2": (FROM_PRETRAINED + [LORA_EXPERTS, "parallel.dp_shard=2"], 2),
}
CASES = [name for name in LAYOUTS if not name.startswith("pretrained") and not name.endswith("single")]
GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny Qwen3-MoE trained a few steps in plain PyTorch and saved with save_pretrained; returns its
    directory, beside its loss on the first global batch paratrain will see."""
    torch.manual_seed(1)
    model = causal_lm(**model_args("qwen3_moe"))
    dataset = build_char_dataset(**TINY_TEXT["args"])
    inputs, targets = (torch.stack(column) for column in zip(*[dataset[i] for i in range(GLOBAL_BATCH)]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss_fn = cross_entropy()
    for _ in range(3):
        optimizer.zero_grad()
        loss_fn(model(torch.flip(inputs, [1])), targets).backward()  # not the batch checked below
        optimizer.step()
    directory = tmp_path_factory.mktemp("hf-experts") / "pretrained"
    model.save_pretrained(directory)
    with torch.no_grad():
        (directory / "first_loss.txt").write_text(repr(loss_fn(model(inputs), targets).item()))
    return directory


@pytest.fixture(scope="module")
def runs(pretrained) -> LayoutRuns:
    return LayoutRuns(
        pretrained.parent,
        LAYOUTS,
        together=tuple(LAYOUTS),
        train={"max_steps": STEPS},
        debug={"dump_gradients_at_steps": [1]},
    )


@pytest.mark.parametrize("case", CASES)
def test_the_familys_layout_matches_one_process_losses_and_first_gradients(runs, case):
    expected = assert_matches_single_process(runs.get(single_of(case)), runs.get(case), steps=STEPS)
    trained = ".lora_A." if case.startswith("lora") else ".mlp.experts.gate_up_proj"
    assert any(trained in name for name in expected)
    if case.startswith("lora_experts"):  # both stacked weights adapted: the two wrappers' adapters trained
        assert any(".mlp.experts.lora_A." in name for name in expected)
        assert any(".mlp.experts.base_layer.lora_A." in name for name in expected)


@pytest.mark.parametrize("case", CASES)
def test_the_familys_layout_logs_one_process_router_counts_and_aux_loss(runs, case):
    expected, actual = read_metrics(runs.get(single_of(case))), read_metrics(runs.get(case))
    fields = ("moe_expert_tokens_min", "moe_expert_tokens_max")  # under cp: summed over both halves
    assert [[r[f] for f in fields] for r in actual] == [[r[f] for f in fields] for r in expected]
    if case.startswith("deepseek_v3"):  # no aux loss of its own: none logged
        assert not any("moe_aux_loss" in record for record in actual + expected)
        return
    aux = {r["step"]: r["moe_aux_loss"] for r in actual}
    assert max_relative_difference(aux, {r["step"]: r["moe_aux_loss"] for r in expected}) <= LOSS_RTOL
    assert min(aux.values()) > 0


def test_deepseek_v3s_router_bias_moves_under_ep_as_in_one_process(runs):
    """moe_balance: bias moves each expert's e_score_correction_bias every step; under ep x2 by the counts
    of both ranks, so the biases (and so the routing: the counts above) stay one process's."""
    name = "model.layers.1.mlp.gate.e_score_correction_bias"  # layer 0 is dense
    expected = checkpoint_weights(runs.get("deepseek_v3_bias single") / f"checkpoints/step-{STEPS}")[name]
    actual = checkpoint_weights(runs.get("deepseek_v3_bias ep x2") / f"checkpoints/step-{STEPS}")[name]
    assert expected.any()  # moved, by 0.01 a step
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)
    untouched = checkpoint_weights(runs.get("deepseek_v3 single") / f"checkpoints/step-{STEPS}")[name]
    assert not untouched.any()  # transformers itself never moves it


def test_a_pretrained_moe_loads_sliced_under_ep_and_exports_in_transformers_layout(runs, pretrained, tmp_path):
    transformers = pytest.importorskip("transformers")
    expected_first = float((pretrained / "first_loss.txt").read_text())
    run = runs.get("pretrained ep x2")
    assert abs(losses_by_step(run)[1] - expected_first) / expected_first <= LOSS_RTOL

    checkpoint = run / f"checkpoints/step-{STEPS}"
    result = run_cli(["export", str(checkpoint), "--hf", str(tmp_path / "hf")])
    assert result.returncode == 0, result.stderr
    # One tensor per expert and projection, as save_pretrained wrote the files it started from.
    assert safetensors_names(tmp_path / "hf") == safetensors_names(pretrained)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    saved = transformers.AutoModelForCausalLM.from_pretrained(pretrained).state_dict()
    trained = checkpoint_weights(checkpoint)
    assert loaded.state_dict().keys() == saved.keys()
    for name, tensor in loaded.state_dict().items():
        assert tensor.shape == saved[name].shape, name  # whole stacked experts, as transformers keeps them
        if name in trained:
            assert torch.equal(tensor, trained[name]), name
    experts = "model.layers.0.mlp.experts.down_proj"
    assert not torch.equal(loaded.state_dict()[experts], saved[experts])  # trained since


def safetensors_names(directory: Path) -> set[str]:
    names = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(file, framework="pt") as handle:
            names.update(handle.keys())
    return names


def single_of(case: str) -> str:
    return f"{case.split()[0]} single"


def test_lora_under_ep_trains_the_adapters_alone_and_exports_an_adapter_peft_loads(runs, pretrained, tmp_path):
    """The saved Qwen3-MoE's experts stay as loaded under ep x2 (sliced, frozen); the exported adapter, loaded by
    peft onto the saved model, gives the logits of paratrain's trained model."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    checkpoint = runs.get("lora ep x2") / f"checkpoints/step-{STEPS}"
    weights = checkpoint_weights(checkpoint)
    base = transformers.AutoModelForCausalLM.from_pretrained(pretrained)
    assert_base_as_loaded(weights, base)
    assert len([name for name in weights if ".lora_" in name]) == 2 * 2 * 2  # A and B, q and v, 2 layers

    result = run_cli(["export", str(checkpoint), "--hf", str(tmp_path / "adapter")])
    assert result.returncode == 0, result.stderr
    assert_peft_gives_our_logits(peft.PeftModel, base, tmp_path / "adapter", adapted(pretrained, weights))


def test_lora_on_the_stacked_experts_exports_an_adapter_peft_loads_and_a_merged_model(runs, pretrained, tmp_path):
    """Under fsdp x2 the adapters on the experts' stacked weights train and the experts stay as loaded; the
    exported adapter (peft's target_parameters) loaded by peft onto the saved model, and the merged export
    loaded by transformers, both give the logits of paratrain's trained model."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    checkpoint = runs.get("lora_experts fsdp x2") / f"checkpoints/step-{STEPS}"
    weights = checkpoint_weights(checkpoint)
    base = transformers.AutoModelForCausalLM.from_pretrained(pretrained)
    assert_base_as_loaded(weights, base)
    expert_adapters = [name for name in weights if ".mlp.experts." in name and ".lora_" in name]
    assert len(expert_adapters) == 2 * 2 * 2  # A and B, gate_up and down, 2 layers
    assert all(weights[name].any() for name in expert_adapters if ".lora_B." in name)  # B starts at zero: trained

    for command, out in ((["--hf"], "adapter"), (["--hf", "--merge"], "merged")):
        result = run_cli(["export", str(checkpoint), *command[:1], str(tmp_path / out), *command[1:]])
        assert result.returncode == 0, result.stderr
    ours = adapted(pretrained, weights, target_parameters=EXPERT_PARAMETERS)
    tokens, logits = assert_peft_gives_our_logits(peft.PeftModel, base, tmp_path / "adapter", ours)
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(merged(input_ids=tokens).logits, logits, rtol=0, atol=1e-5)


def assert_base_as_loaded(weights: dict[str, torch.Tensor], base: torch.nn.Module) -> None:
    """Every trained checkpoint tensor but the adapters' equals the saved model's, under its own name."""
    from paratrain.models.lora import base_name

    for name, tensor in weights.items():
        if ".lora_" not in name:
            assert torch.equal(tensor, base.state_dict()[base_name(name)]), f"{name} moved"


def assert_peft_gives_our_logits(
    peft_model: type, base: torch.nn.Module, adapter: Path, ours: torch.nn.Module
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exported ``adapter`` loaded by peft onto ``base`` gives ``ours``'s logits; returns (tokens, logits)."""
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = ours(tokens).logits
        loaded = peft_model.from_pretrained(base, str(adapter)).eval()
        torch.testing.assert_close(loaded(input_ids=tokens).logits, logits, rtol=0, atol=1e-5)
    return tokens, logits


def adapted(pretrained: Path, weights: dict[str, torch.Tensor], **lora) -> torch.nn.Module:
    """The saved model with LoRA applied as training applies it and a checkpoint's tensors loaded."""
    import transformers

    from paratrain.config.schema import LoraConfig
    from paratrain.models.lora import apply_lora

    model = transformers.AutoModelForCausalLM.from_pretrained(pretrained)
    model = apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"], **lora))
    model.load_state_dict(weights)
    return model.eval()
