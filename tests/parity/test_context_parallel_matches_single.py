"""Context parallel (parallel.cp, all_to_all exchange) and document masking train like a single process:
paratrain's GPT, a transformers Llama (grouped-query attention) and Mistral (sliding window), alone and
beside dp_shard, tp and pp; checkpoints hold nothing cp-specific, so a cp run resumes without cp and back,
and a killed cp run resumes bit-identical."""

from __future__ import annotations

import pytest
import torch

from paratrain.data.lm import packed_text
from paratrain.data.stdlib_corpus import train_tokenizer, write_stdlib_corpus
from tests.harness import (
    LayoutRuns,
    assert_matches_single_process,
    checkpoint_weights,
    losses_by_step,
    max_relative_difference,
    tiny_config,
    train,
    write_config,
)

pytestmark = pytest.mark.timeout(900)

# Checkpoints every 3 steps: a chain resumes at the middle (6) and three quarters (9) of 12 steps.
STEPS, EVERY, MIDPOINT, LATE = 12, 3, 6, 9
LOSS_RTOL = 1e-5
SEQ = 32  # cp=4 cuts it into 8 chunks of 4 tokens

GPT = [
    "model.factory=paratrain.models.gpt:build_gpt",
    f"model.args={{vocab_size: 300, block_size: {SEQ}, n_head: 4, n_embd: 32}}",
]
# Grouped-query attention (8 query heads over 4 key/value heads), so cp=4 and cp x tp=2x2 divide both.
LLAMA = [
    "model.factory=paratrain.models.hf:causal_lm",
    "model.args={model_type: llama, vocab_size: 300, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
    f"num_attention_heads: 8, num_key_value_heads: 4, max_position_embeddings: {SEQ}}}",
]
# Mistral's sliding window (8 of 32 tokens): attention masks what lies further back, on every cp rank too.
MISTRAL = [
    "model.factory=paratrain.models.hf:causal_lm",
    "model.args={model_type: mistral, vocab_size: 300, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
    f"num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: {SEQ}, sliding_window: 8}}",
]
DOCUMENTS = ["data.args.document_mask=true"]
CP2, CP4 = ["parallel.cp=2"], ["parallel.cp=4"]
CP_FSDP = ["parallel.cp=2", "parallel.dp_shard=2"]
CP_TP = ["parallel.cp=2", "parallel.tp=2"]
CP_PP = ["parallel.cp=2", "parallel.pp=2"]

LAYOUTS = {
    "gpt single": (GPT, 1),
    "gpt single documents": (GPT + DOCUMENTS, 1),
    "llama single": (LLAMA, 1),
    "llama single documents": (LLAMA + DOCUMENTS, 1),
    "mistral single": (MISTRAL, 1),
    "gpt cp x2": (GPT + CP2, 2),
    "gpt cp x2 documents": (GPT + CP2 + DOCUMENTS, 2),
    "llama cp x2": (LLAMA + CP2, 2),
    "mistral cp x2": (MISTRAL + CP2, 2),
    "gpt cp x4": (GPT + CP4, 4),
    "gpt cp x dp_shard 2x2": (GPT + CP_FSDP, 4),
    "gpt cp x dp_shard 2x2 documents": (GPT + CP_FSDP + DOCUMENTS, 4),
    "gpt cp x tp 2x2": (GPT + CP_TP, 4),
    "gpt cp x pp 2x2": (GPT + CP_PP, 4),
    "llama cp x4": (LLAMA + CP4, 4),
    "llama cp x dp_shard 2x2 documents": (LLAMA + CP_FSDP + DOCUMENTS, 4),
    "llama cp x tp 2x2": (LLAMA + CP_TP, 4),
    "llama cp x pp 2x2": (LLAMA + CP_PP, 4),
    # A cp checkpoint resumed without cp (fsdp x2) at the midpoint, and that one's later step back under cp x2.
    "gpt cp x4 to fsdp x2": (
        GPT + ["parallel.dp_shard=2", f"checkpoint.resume={{run:gpt cp x4}}/checkpoints/step-{MIDPOINT}"],
        2,
    ),
    "gpt fsdp x2 to cp x2": (
        GPT + CP2 + [f"checkpoint.resume={{run:gpt cp x4 to fsdp x2}}/checkpoints/step-{LATE}"],
        2,
    ),
}
CP_LAYOUTS = [name for name in LAYOUTS if " cp " in name and " to " not in name]


@pytest.fixture(scope="module")
def token_data(tmp_path_factory) -> dict:
    """The stdlib corpus, a small tokenizer trained on it, tokenized once here: documents end with EOS, so
    windows of 32 tokens hold document boundaries for the document mask to act on."""
    root = tmp_path_factory.mktemp("cp-corpus")
    write_stdlib_corpus(root / "corpus.jsonl")
    train_tokenizer(root / "corpus.jsonl", root / "tokenizer.json", vocab_size=300)
    args = {"files": str(root / "corpus.jsonl"), "tokenizer": str(root), "cache_dir": str(root / "cache")}
    dataset = packed_text(**args, block_size=SEQ, document_mask=True)
    windows = torch.stack([dataset[index][0] for index in range(len(dataset))])
    crossing = (windows == dataset.document_end_id).any(dim=1).float().mean().item()
    assert crossing > 0.1, "a good share of the (shuffled) windows cross a document boundary"
    return {"factory": "paratrain.data.lm:packed_text", "args": {**args, "block_size": SEQ}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, token_data) -> LayoutRuns:
    return LayoutRuns(
        tmp_path_factory.mktemp("cp"),
        LAYOUTS,
        together=tuple(LAYOUTS),
        train={"max_steps": STEPS},
        data=token_data,
        checkpoint={"every_steps": EVERY, "keep_last": None},
        debug={"dump_gradients_at_steps": [1]},
    )


def single_of(layout: str) -> str:
    model = layout.split()[0]
    return f"{model} single documents" if layout.endswith("documents") else f"{model} single"


@pytest.mark.parametrize("layout", CP_LAYOUTS)
def test_context_parallel_matches_a_single_process_losses_and_first_gradients(runs, layout):
    reference, laid_out = runs.get(single_of(layout)), runs.get(layout)
    assert_matches_single_process(reference, laid_out, steps=STEPS, loss_rtol=LOSS_RTOL)


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_document_masking_changes_what_a_single_process_computes(runs, model):
    # Without this, the documents runs above could match their references by both ignoring the mask.
    plain, masked = losses_by_step(runs.get(f"{model} single")), losses_by_step(runs.get(f"{model} single documents"))
    assert max_relative_difference(masked, plain) > 1e-4


def test_a_cp_checkpoint_resumes_without_cp_and_back_and_trains_on_identically(runs):
    origin = losses_by_step(runs.get("gpt cp x4"))
    chained = {
        **{s: loss for s, loss in losses_by_step(runs.get("gpt cp x4 to fsdp x2")).items() if MIDPOINT < s <= LATE},
        **{s: loss for s, loss in losses_by_step(runs.get("gpt fsdp x2 to cp x2")).items() if s > LATE},
    }
    assert sorted(chained) == list(range(MIDPOINT + 1, STEPS + 1))
    assert max_relative_difference(chained, {s: origin[s] for s in chained}) <= LOSS_RTOL
    expected = checkpoint_weights(runs.get("gpt cp x4") / f"checkpoints/step-{STEPS}")
    actual = checkpoint_weights(runs.get("gpt fsdp x2 to cp x2") / f"checkpoints/step-{STEPS}")
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=1e-5, msg=name)


def test_a_killed_cp_run_resumes_bit_identical(tmp_path, token_data):
    """cp x2 with document masking, killed after step 12 on its last rank, resumed from step 5 in a new
    launch: its step-10 checkpoint equals the killed run's bit for bit."""
    sections = {"data": token_data, "checkpoint": {"every_steps": 5, "keep_last": None}}
    config = write_config(tmp_path / "run.yaml", tiny_config(tmp_path / "killed", train={"max_steps": 16}, **sections))
    layout = [*GPT, *CP2, *DOCUMENTS]
    killed = train(config, *layout, nproc=2, env={"PARATRAIN_FAULT": "after_step:12:1"}, check=False)
    assert killed.returncode != 0, killed.stderr[-2000:]
    assert (tmp_path / "killed/checkpoints/step-10/paratrain-manifest.json").is_file()
    resumed = tmp_path / "resumed"
    train(
        config, *layout, f"checkpoint.resume={tmp_path}/killed/checkpoints/step-5", f"run.output_dir={resumed}", nproc=2
    )
    expected = checkpoint_weights(tmp_path / "killed/checkpoints/step-10")
    actual = checkpoint_weights(resumed / "checkpoints/step-10")
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), f"{name} differs after resume"
    assert losses_by_step(resumed)[10] == losses_by_step(tmp_path / "killed")[10]
