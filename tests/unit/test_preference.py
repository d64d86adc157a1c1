"""Preference data and the DPO loss in one process: rows in TRL's columns become (chosen, rejected) pairs whose
targets are the completions alone, each of a pair's sequences is computed as if alone, and the loss is DPO's
sigmoid loss over the pairs (log 2 where the model is its reference)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from paratrain.data.preference import preference_data
from paratrain.errors import ConfigError
from paratrain.losses import IGNORE_INDEX, completion_log_probs, dpo
from paratrain.parallel.documents import MarkedStarts
from tests.chat_fixtures import write_chat_tokenizer, write_preference_jsonl

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_chat_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def words_of(tokenizer_dir, ids):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir).convert_ids_to_tokens([int(i) for i in ids])


@pytest.mark.parametrize("conversational", [True, False], ids=["chat turns", "strings"])
def test_a_pair_holds_the_chosen_then_the_rejected_sequence_with_only_the_completions_as_targets(
    tmp_path, tokenizer_dir, conversational
):
    path = write_preference_jsonl(tmp_path / "pref.jsonl", 4, conversational=conversational)
    pairs = preference_data(files=str(path), tokenizer=str(tokenizer_dir), seq_len=16, cache_dir=str(tmp_path / "c"))
    assert len(pairs) == 4
    inputs, targets = pairs[1]
    ids, starts = MarkedStarts().split(inputs.unsqueeze(0))
    assert inputs.shape == (32,) and starts[0, 0] and starts[0, 16]  # two sequences, each begun at 0 and 16
    row = json.loads(path.read_text().splitlines()[1])
    for half, column in enumerate(("chosen", "rejected")):
        labels = targets["labels"][half * 16 : (half + 1) * 16]
        kept = words_of(tokenizer_dir, [t for t in labels if t != IGNORE_INDEX])
        reply = row[column][0]["content"] if conversational else row[column]
        assert kept[: len(reply.split())] == reply.split()  # the completion (and its end of turn), not the prompt
    assert torch.isnan(targets["reference"]).all()  # computed before training, from the model as it starts


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"prompt": "hi", "chosen": "one"}, "has no 'rejected' column"),
        ({"prompt": "hi", "chosen": "one", "rejected": "one"}, "'chosen' and 'rejected' are the same completion"),
        ({"prompt": " ".join(["one"] * 40), "chosen": " two", "rejected": " three"}, "leaving no completion"),
    ],
    ids=["missing rejected", "chosen equals rejected", "prompt longer than seq_len"],
)
def test_bad_preference_rows_are_refused_naming_the_file_and_row(tmp_path, tokenizer_dir, row, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "chosen": "one", "rejected": "two"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=f"{path} row 2.*{expected}"):
        preference_data(files=str(path), tokenizer=str(tokenizer_dir), seq_len=16, cache_dir=str(tmp_path / "c"))


def test_the_dpo_loss_is_log_2_at_the_reference_and_follows_the_sigmoid_formula():
    torch.manual_seed(0)
    logits = torch.randn(3, 8, 11)
    labels = torch.randint(0, 11, (3, 8))
    labels[:, :2] = IGNORE_INDEX  # a prompt
    labels[:, 4:6] = IGNORE_INDEX  # the rejected sequence's prompt
    policy = completion_log_probs(logits, labels)
    per_token = F.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0] * (labels >= 0)
    torch.testing.assert_close(policy, torch.stack([per_token[:, :4].sum(1), per_token[:, 4:].sum(1)], dim=1))
    loss = dpo(beta=0.5)
    assert loss(logits, {"labels": labels, "reference": policy}).item() == pytest.approx(math.log(2))
    reference = policy - torch.tensor([[1.0, -2.0]])  # the policy prefers chosen by 3 nats more than the reference
    smoothed = dpo(beta=0.5, label_smoothing=0.1)
    expected = -(0.9 * F.logsigmoid(torch.tensor(1.5)) + 0.1 * F.logsigmoid(torch.tensor(-1.5)))
    assert smoothed(logits, {"labels": labels, "reference": reference}).item() == pytest.approx(expected.item())
    sums, pairs = smoothed.window_metrics()
    assert pairs == 3 and sums["rewards/margins"].item() == pytest.approx(3 * 1.5)
    assert sums["rewards/accuracies"].item() == 3


def test_dpo_arguments_out_of_range_are_refused():
    with pytest.raises(ValueError, match="beta=0"):
        dpo(beta=0)


def test_the_dpo_loss_on_a_batch_equals_trls_dpo_trainer_on_the_same_batch(tmp_path, tokenizer_dir):
    """TRL's DPOTrainer (its own tokenization, batching and loss) against paratrain's pairs, attention within each
    sequence and DPO loss, for the same rows, policy and reference weights: the same token ids, the same loss."""
    trl = pytest.importorskip("trl")
    import transformers
    from datasets import Dataset

    from paratrain.models.attention_hooks import install_sequence_functions
    from paratrain.parallel.sequence_sharding import SequenceSharding
    from tests.chat_fixtures import preference_row

    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    models = []
    for seed in (0, 1):  # the policy, and a reference that differs from it
        torch.manual_seed(seed)
        models.append(transformers.AutoModelForCausalLM.from_config(config))
    rows = [preference_row(index) for index in range(4)]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"), beta=0.5, per_device_train_batch_size=4, report_to=[], use_cpu=True
    )
    trainer = trl.DPOTrainer(
        model=models[0],
        ref_model=models[1],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    batch = trainer.data_collator([trainer.train_dataset[index] for index in range(4)])
    theirs = trainer.compute_loss(trainer.model, batch).item()

    path = tmp_path / "pref.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    pairs = preference_data(files=str(path), tokenizer=str(tokenizer_dir), seq_len=16, cache_dir=str(tmp_path / "c"))
    for index, (chosen, rejected) in enumerate(pairs.pairs):  # the very tokens TRL trains on
        for sample, row in ((chosen, index), (rejected, index + 4)):
            length = int(batch["attention_mask"][row].sum())
            assert sample.tokens == batch["input_ids"][row, :length].tolist()
    inputs = torch.stack([pairs[index][0] for index in range(4)])
    labels = torch.stack([pairs[index][1]["labels"] for index in range(4)])
    logits = []
    for model in models:  # each sequence of a pair computed alone (marked starts), as TRL computes each apart
        sharding = SequenceSharding(cp=1, cp_rank=0, cp_group=None, documents=MarkedStarts())
        install_sequence_functions(model, attention=sharding.attention, positions=sharding.positions)
        logits.append(model(sharding.whole(inputs)).logits)
        sharding.release()
    reference = completion_log_probs(logits[1].detach(), labels)
    ours = dpo(beta=0.5)(logits[0], {"labels": labels, "reference": reference}).item()
    assert ours == pytest.approx(theirs, rel=1e-5)
