"""Packed chat samples (paratrain/data/packing.py): best-fit decreasing places every sample once within the
row length, and a packed row computes each sample as if it were alone: its logits and per-token losses,
through a real transformers Llama and paratrain's GPT, equal those of the sample unpacked."""

from __future__ import annotations

import random

import pytest
import torch

from paratrain.data.chat import ChatSample, chat_data
from paratrain.data.packing import PackedSamples, best_fit
from paratrain.losses import IGNORE_INDEX
from paratrain.models.attention_hooks import install_sequence_functions
from paratrain.models.gpt import build_gpt
from paratrain.models.hf import causal_lm
from paratrain.parallel.documents import MarkedStarts, without_marks
from paratrain.parallel.sequence_sharding import SequenceSharding
from tests.chat_fixtures import write_chat_jsonl, write_chat_tokenizer

pytest.importorskip("transformers")


def test_best_fit_places_every_sample_once_within_the_row_and_fills_rows():
    rng = random.Random(0)
    lengths = [min(2048, max(8, int(rng.lognormvariate(5.7, 0.8)))) for _ in range(3000)]  # median ~300, a tail
    rows = best_fit(lengths, 2048)
    placed = sorted(index for row in rows for index in row)
    assert placed == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 2048 for row in rows)
    fill = sum(lengths) / (len(rows) * 2048)
    assert fill > 0.95, fill  # padding under 5 % of the tokens
    assert best_fit(lengths, 2048) == rows  # the same packing in every process


def samples(count: int, *, vocab: int = 60, seed: int = 0) -> list[ChatSample]:
    """Conversations of uneven lengths whose labels keep a few spans (the replies)."""
    rng = random.Random(seed)
    made = []
    for _ in range(count):
        length = rng.randint(3, 12)
        tokens = [rng.randrange(1, vocab) for _ in range(length)]
        labels = [token if rng.random() < 0.5 else IGNORE_INDEX for token in tokens]
        made.append(ChatSample(tokens, labels))
    return made


def test_a_packed_row_holds_each_samples_own_inputs_and_targets_and_marks_its_start():
    data = samples(20)
    packed = PackedSamples(data, seq_len=24, pad_id=0, vocab_size=60)
    seen = 0
    for index in range(len(packed)):
        inputs, targets = packed[index]
        ids, starts = MarkedStarts().split(inputs.unsqueeze(0))
        at = 0
        for sample in (data[i] for i in packed.rows[index]):
            length = len(sample.tokens) - 1
            assert starts[0, at] and ids[0, at : at + length].tolist() == sample.tokens[:-1]
            assert targets[at : at + length].tolist() == sample.labels[1:]
            at, seen = at + length, seen + 1
        assert (targets[at:] == IGNORE_INDEX).all()
    assert seen == len(data)


def llama():
    torch.manual_seed(0)
    return causal_lm(
        model_type="llama", vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip


def gpt():
    torch.manual_seed(0)
    return build_gpt(vocab_size=60, block_size=32, n_layer=2, n_head=2, n_embd=32)


def logits_of(output) -> torch.Tensor:
    return getattr(output, "logits", output)


@pytest.mark.parametrize("build", [llama, gpt], ids=["llama", "gpt"])
def test_each_packed_sample_gives_the_logits_and_per_token_losses_it_gives_alone(build):
    data = samples(12, seed=1)
    packed = PackedSamples(data, seq_len=32, pad_id=0, vocab_size=60)
    alone_model, packed_model = build(), build()
    sharding = SequenceSharding(cp=1, cp_rank=0, cp_group=None, documents=MarkedStarts())
    install_sequence_functions(packed_model, attention=sharding.attention, positions=sharding.positions)
    batch_inputs, batch_targets = (torch.stack(parts) for parts in zip(*[packed[i] for i in range(len(packed))]))
    inputs, targets = sharding.shard(batch_inputs, batch_targets)
    with torch.no_grad():
        logits = logits_of(packed_model(inputs))
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    for row, members in enumerate(packed.rows):
        at = 0
        for sample in (data[i] for i in members):
            length = len(sample.tokens) - 1
            alone_inputs = torch.tensor([sample.tokens[:-1]])
            with torch.no_grad():
                alone = logits_of(alone_model(alone_inputs))
            torch.testing.assert_close(logits[row, at : at + length], alone[0], rtol=1e-5, atol=1e-5)
            alone_losses = torch.nn.functional.cross_entropy(
                alone[0], torch.tensor(sample.labels[1:]), reduction="none"
            )
            torch.testing.assert_close(losses[row, at : at + length], alone_losses, rtol=1e-5, atol=1e-5)
            at += length


def test_chat_data_packs_by_default_and_pads_one_conversation_per_row_when_asked(tmp_path):
    tokenizer = write_chat_tokenizer(tmp_path / "tokenizer")
    path = write_chat_jsonl(tmp_path / "chat.jsonl", 40)
    packed = chat_data(files=str(path), tokenizer=str(tokenizer), seq_len=64)
    unpacked = chat_data(files=str(path), tokenizer=str(tokenizer), seq_len=64, pack=False)
    assert isinstance(packed, PackedSamples) and len(unpacked) == 40 and len(packed) < 40 / 2
    targets = lambda data: sum(int((data[i][1] != IGNORE_INDEX).sum()) for i in range(len(data)))  # noqa: E731
    assert targets(packed) == targets(unpacked)  # the same target tokens: the loss is a mean over the same set
    inputs, _ = packed[0]
    assert without_marks(inputs).max() < packed.vocab_size < inputs.max()  # marked ids, cleared before the model
