"""DPO on a pretrained tiny Llama: ddp x2, fsdp x2 and hsdp 2x2 train like one process over 10 steps (losses,
the rewards the log gives, final weights), with LoRA as without, and a resume reads the reference
log-probabilities from its checkpoint instead of computing them from a model that is no longer the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.chat_fixtures import write_chat_tokenizer, write_preference_jsonl
from tests.harness import (
    LayoutRuns,
    checkpoint_weights,
    losses_by_step,
    max_relative_difference,
    max_weight_difference,
    read_metrics,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(600)

STEPS = 10
LLAMA = dict(
    vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
LORA = "model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj]}"
LAYOUTS = {
    "single": (["parallel.strategy=single"], 1),
    "ddp": (["parallel.strategy=ddp", "train.micro_batch_size=1"], 2),
    "fsdp": (["parallel.strategy=fsdp"], 2),
    "hsdp": (["parallel.strategy=hsdp", "parallel.dp_replicate=2", "train.micro_batch_size=1"], 4),
    "resumed": (["parallel.strategy=single", "checkpoint.resume={run:fsdp}/checkpoints/step-5"], 1),
    "lora single": ([LORA, "parallel.strategy=single", "optim.lr=1e-2"], 1),
    "lora fsdp": ([LORA, "parallel.strategy=fsdp", "optim.lr=1e-2"], 2),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> LayoutRuns:
    root = tmp_path_factory.mktemp("dpo-inputs")
    torch.manual_seed(1)
    base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **LLAMA))
    base.save_pretrained(root / "base")
    data = {
        "files": str(write_preference_jsonl(root / "pref.jsonl", 48)),
        "tokenizer": str(write_chat_tokenizer(root / "tokenizer")),
        "seq_len": 16,
        "cache_dir": str(root / "cache"),
    }
    return LayoutRuns(
        tmp_path_factory.mktemp("dpo"),
        LAYOUTS,
        together=tuple(LAYOUTS),
        train={"max_steps": STEPS, "deterministic": True},
        optim={"lr": 1e-3, "warmup_steps": 2},
        checkpoint={"every_steps": 5, "keep_last": None},
        model={"factory": "paratrain.models.hf:causal_lm", "args": {}, "pretrained": str(root / "base")},
        data={"factory": "paratrain.data.preference:preference_data", "args": data},
        loss={"factory": "paratrain.losses:dpo", "args": {"beta": 0.5}},
    )


def rewards(run: Path) -> dict[int, float]:
    return {record["step"]: record["rewards/margins"] for record in read_metrics(run) if "rewards/margins" in record}


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "hsdp", "resumed", "lora fsdp"])
def test_dpo_trains_alike_under_data_parallel_layouts_and_resumes_exactly(runs, layout):
    reference, other = runs.get("lora single" if layout.startswith("lora") else "single"), runs.get(layout)
    single_losses = losses_by_step(reference)
    assert single_losses[1] == pytest.approx(0.6931472, abs=1e-6)  # the model starts as its own reference
    assert single_losses[STEPS] < single_losses[1], "the model should come to prefer the chosen completions"
    losses = losses_by_step(other)
    shared = {step: single_losses[step] for step in losses}
    assert max_relative_difference(losses, shared) <= 1e-5
    margins, single_margins = rewards(other), rewards(reference)
    assert all(abs(margins[step] - single_margins[step]) <= 1e-5 for step in margins)
    final = f"checkpoints/step-{STEPS}"
    assert max_weight_difference(checkpoint_weights(other / final), checkpoint_weights(reference / final)) <= 1e-5


def test_a_resume_reads_the_reference_from_its_checkpoint(runs):
    saved = checkpoint_weights(runs.get("fsdp") / "checkpoints/step-5", prefix="preference_reference.")
    assert saved["logps"].shape == (48, 2) and not torch.isnan(saved["logps"]).any()
    log = (runs.get("resumed") / "metrics.jsonl").read_text()
    assert log and losses_by_step(runs.get("resumed"))[6] == pytest.approx(
        losses_by_step(runs.get("single"))[6], rel=1e-5
    )
