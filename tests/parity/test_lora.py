"""Fine-tuning a pretrained tiny Llama on packed chat data (the default: samples packed into rows, each computed
alone), with LoRA through peft and without: ddp x2, fsdp x2, cp x2, fsdp x cp 2x2 and hsdp 2x2 train like one
process, only the adapters train (the base stays as loaded), a resume is exact, and the exported adapter, loaded
by peft, gives the logits of paratrain's model (as does the merged export, loaded by transformers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.chat_fixtures import write_chat_jsonl, write_chat_tokenizer
from tests.harness import (
    LayoutRuns,
    checkpoint_weights,
    losses_by_step,
    max_relative_difference,
    max_weight_difference,
    read_metrics,
    run_cli,
)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(600)

STEPS = 12
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5
LLAMA = dict(
    vocab_size=32,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
LORA = "model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj, down_proj]}"
LAYOUTS = {
    "single": ([LORA, "parallel.strategy=single"], 1),
    "ddp": ([LORA, "parallel.strategy=ddp", "train.micro_batch_size=1"], 2),
    "fsdp": ([LORA, "parallel.strategy=fsdp"], 2),
    # context parallel: each rank holds a different number of a padded chat sample's targets
    "fsdp cp": ([LORA, "parallel.strategy=fsdp", "parallel.cp=2"], 2),
    "hsdp": ([LORA, "parallel.strategy=hsdp", "parallel.dp_replicate=2", "train.micro_batch_size=1"], 4),
    "fsdp x cp": ([LORA, "parallel.strategy=fsdp", "parallel.dp_shard=2", "parallel.cp=2"], 4),
    # the fsdp run's step 6, resumed on one process to the end
    "resumed": ([LORA, "parallel.strategy=single", "checkpoint.resume={run:fsdp}/checkpoints/step-6"], 1),
    # every weight trains: a smaller learning rate
    **{
        f"full {name}": ([*overrides, "optim.lr=1e-3"], nproc)
        for name, (overrides, nproc) in {
            "single": (["parallel.strategy=single"], 1),
            "ddp": (["parallel.strategy=ddp", "train.micro_batch_size=1"], 2),
            "fsdp": (["parallel.strategy=fsdp"], 2),
            "cp": (["parallel.strategy=fsdp", "parallel.cp=2"], 2),
            "fsdp x cp": (["parallel.strategy=fsdp", "parallel.dp_shard=2", "parallel.cp=2"], 4),
        }.items()
    },
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-inputs")
    torch.manual_seed(1)
    base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **LLAMA))
    base.save_pretrained(root / "base")
    return {
        "base": root / "base",
        "tokenizer": write_chat_tokenizer(root / "tokenizer"),
        "chat": write_chat_jsonl(root / "chat.jsonl", 64),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, inputs) -> LayoutRuns:
    chat = {"files": str(inputs["chat"]), "tokenizer": str(inputs["tokenizer"]), "seq_len": 24}
    return LayoutRuns(
        tmp_path_factory.mktemp("lora"),
        LAYOUTS,
        together=tuple(LAYOUTS),
        train={"max_steps": STEPS, "deterministic": True},
        optim={"lr": 1e-2, "warmup_steps": 2},
        checkpoint={"every_steps": 6, "keep_last": None},
        model={"factory": "paratrain.models.hf:causal_lm", "args": {}, "pretrained": str(inputs["base"])},
        data={"factory": "paratrain.data.chat:chat_data", "args": chat},
        # evaluation over conversations of different target counts: a token-weighted mean on every layout
        eval={"factory": "paratrain.data.chat:chat_data", "args": {**chat, "seq_len": 16}, "every_steps": 6},
    )


@pytest.mark.parametrize(
    "layout",
    ["ddp", "fsdp", "fsdp cp", "fsdp x cp", "hsdp", "resumed", "full ddp", "full fsdp", "full cp", "full fsdp x cp"],
)
def test_packed_fine_tuning_trains_alike_under_data_parallel_layouts_and_resumes_exactly(runs, layout):
    reference, other = runs.get("full single" if layout.startswith("full") else "single"), runs.get(layout)
    single_losses = losses_by_step(reference)
    assert single_losses[STEPS] < single_losses[1] - 0.05, "the model should learn"
    losses = losses_by_step(other)
    assert (
        max_relative_difference(
            {s: losses[s] for s in single_losses if s in losses}, {s: single_losses[s] for s in losses}
        )
        <= LOSS_RTOL
    )
    final = f"checkpoints/step-{STEPS}"
    assert (
        max_weight_difference(checkpoint_weights(other / final), checkpoint_weights(reference / final)) <= WEIGHT_ATOL
    )
    evaluated, reference_eval = (
        {record["step"]: record["eval_loss"] for record in read_metrics(run) if "eval_loss" in record}
        for run in (other, reference)
    )
    assert STEPS in evaluated and abs(evaluated[STEPS] - reference_eval[STEPS]) <= LOSS_RTOL * reference_eval[STEPS]


def test_only_the_adapters_train_and_hold_optimizer_state(runs, inputs):
    weights = checkpoint_weights(runs.get("fsdp") / f"checkpoints/step-{STEPS}")
    base = transformers.AutoModelForCausalLM.from_pretrained(inputs["base"]).state_dict()
    frozen = {name: tensor for name, tensor in weights.items() if ".lora_" not in name}
    for name, tensor in frozen.items():
        assert torch.equal(tensor, base[name.replace(".base_layer.", ".")]), f"{name} moved"
    adapters = sorted(name for name in weights if ".lora_" in name)
    assert len(adapters) == 2 * 3 * 2  # A and B, 3 targets, 2 layers
    moments = checkpoint_weights(runs.get("fsdp") / f"checkpoints/step-{STEPS}", prefix="optimizer.state.")
    assert moments and all(".lora_" in name for name in moments)


def adapted_model(inputs, checkpoint: Path):
    """paratrain's model in memory: the base, LoRA applied as training applies it, the checkpoint's tensors."""
    from paratrain.config.schema import LoraConfig
    from paratrain.models.lora import apply_lora

    model = transformers.AutoModelForCausalLM.from_pretrained(inputs["base"])
    model = apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    model.load_state_dict(checkpoint_weights(checkpoint))
    return model.eval()


def test_exported_adapter_loaded_by_peft_and_merged_export_give_paratrain_logits(runs, inputs, tmp_path):
    checkpoint = runs.get("fsdp") / f"checkpoints/step-{STEPS}"
    for extra, out in (([], tmp_path / "adapter"), (["--merge"], tmp_path / "merged")):
        result = run_cli(["export", str(checkpoint), "--hf", str(out), *extra])
        assert result.returncode == 0, result.stderr
    tokens = torch.randint(0, 28, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = adapted_model(inputs, checkpoint)(tokens).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(inputs["base"])
        base_logits = base(tokens).logits
        loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()  # adapts base in place
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(loaded(input_ids=tokens).logits, ours, rtol=0, atol=1e-5)
        torch.testing.assert_close(merged(tokens).logits, ours, rtol=0, atol=1e-5)
        assert (ours - base_logits).abs().max() > 1e-3, "the adapter changes the logits"


def test_a_lora_checkpoint_resumed_as_a_full_fine_tune_is_refused_naming_model_lora(runs, tmp_path):
    checkpoint = runs.get("single") / "checkpoints/step-6"
    config = runs.root / "single.yaml"  # the shared config, without the layouts' model.lora override
    result = run_cli(["train", str(config), f"run.output_dir={tmp_path}", f"checkpoint.resume={checkpoint}"])
    assert result.returncode == 2, result.stderr
    assert "model.lora: {'r': 4" in result.stderr and "-> None" in result.stderr
    assert "checkpoint.allow_config_change" in result.stderr
