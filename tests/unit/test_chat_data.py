"""Chat data: the tokenizer's template renders each conversation, and only the assistant's replies are targets."""

from __future__ import annotations

import json

import pytest

from paratrain.data.chat import chat_data
from paratrain.errors import ConfigError
from paratrain.losses import IGNORE_INDEX
from tests.chat_fixtures import MARKED_TEMPLATE, write_chat_jsonl, write_chat_tokenizer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_chat_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def words_of(tokenizer_dir, ids):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir).convert_ids_to_tokens([int(i) for i in ids])


def test_only_the_assistant_replies_and_their_end_of_turn_are_targets(tmp_path, tokenizer_dir):
    rows = [
        {
            "messages": [
                {"role": "system", "content": "hi"},
                {"role": "user", "content": "what is two plus three"},
                {"role": "assistant", "content": "five"},
                {"role": "user", "content": "how are you"},
                {"role": "assistant", "content": "fine thanks"},
            ]
        }
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    inputs, targets = chat_data(files=str(path), tokenizer=str(tokenizer_dir), seq_len=32, pack=False)[0]
    kept = [int(t) for t in targets if t != IGNORE_INDEX]
    assert words_of(tokenizer_dir, kept) == ["five", "<|end|>", "fine", "thanks", "<|end|>"]
    assert words_of(tokenizer_dir, inputs[:3]) == ["<|system|>", "hi", "<|end|>"]
    length = 23  # tokens of the rendering; inputs are all but the last, then padding
    assert (inputs[length - 1 :] == 0).all() and (targets[length - 1 :] == IGNORE_INDEX).all()


def test_generation_markers_and_prefix_rendering_find_the_same_replies(tmp_path, tokenizer_dir):
    path = write_chat_jsonl(tmp_path / "chat.jsonl", 12)
    by_prefix = chat_data(files=str(path), tokenizer=str(tokenizer_dir), seq_len=40)
    by_markers = chat_data(files=str(path), tokenizer=str(tokenizer_dir), seq_len=40, chat_template=MARKED_TEMPLATE)
    assert len(by_prefix) == len(by_markers) < 12  # packed: fewer rows than conversations
    for index in range(len(by_prefix)):
        assert all((a == b).all() for a, b in zip(by_prefix[index], by_markers[index], strict=True))


def test_prompt_completion_rows_and_a_saved_dataset_read_alike(tmp_path, tokenizer_dir):
    datasets = pytest.importorskip("datasets")
    path = write_chat_jsonl(tmp_path / "pc.jsonl", 6, columns="prompt/completion")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    from_jsonl = chat_data(files=str(path), tokenizer=str(tokenizer_dir), seq_len=24, pack=False)
    from_disk = chat_data(files=str(tmp_path / "saved"), tokenizer=str(tokenizer_dir), seq_len=24, pack=False)
    assert len(from_jsonl) == len(from_disk) == 6
    inputs, targets = from_disk[1]
    assert words_of(tokenizer_dir, inputs[:1]) == ["<|user|>"]
    assert (targets != IGNORE_INDEX).sum() >= 2  # a reply word and its end of turn


def test_long_conversations_are_truncated_or_dropped_and_counted(tmp_path, tokenizer_dir, caplog):
    path = write_chat_jsonl(tmp_path / "chat.jsonl", 12)
    with caplog.at_level("INFO", logger="paratrain.data.chat"):
        kept = chat_data(files=str(path), tokenizer=str(tokenizer_dir), seq_len=12, overflow="drop")
        cut = chat_data(files=str(path), tokenizer=str(tokenizer_dir), seq_len=12)
    assert len(kept) < len(cut) <= 12
    assert all(len(sample.tokens) <= 13 for sample in cut.samples)
    assert "0 truncated and" in caplog.text and f"{12 - len(kept)} dropped" in caplog.text


def test_a_tokenizer_without_chat_template_is_refused_naming_the_fix(tmp_path):
    bare = write_chat_tokenizer(tmp_path / "bare", template=None)
    path = write_chat_jsonl(tmp_path / "chat.jsonl", 2)
    with pytest.raises(ConfigError, match="no chat template.*data.args.chat_template"):
        chat_data(files=str(path), tokenizer=str(bare), seq_len=16)


def test_paratrain_loss_on_a_chat_sample_equals_the_loss_transformers_computes_from_labels(tmp_path, tokenizer_dir):
    import torch

    from paratrain.losses import cross_entropy
    from paratrain.models.hf import causal_lm

    path = write_chat_jsonl(tmp_path / "c.jsonl", 4)
    data = chat_data(files=str(path), tokenizer=str(tokenizer_dir), seq_len=40, pack=False)
    torch.manual_seed(0)
    model = causal_lm(
        model_type="llama",
        vocab_size=data.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    sample = data.samples[1]
    inputs, targets = data[1]
    ours = cross_entropy()(model(inputs[None]), targets[None])
    tokens, labels = torch.tensor([sample.tokens]), torch.tensor([sample.labels])
    theirs = model(input_ids=tokens, labels=labels).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_conversations_are_tokenized_once_and_again_only_when_an_input_changes(tmp_path, tokenizer_dir, caplog):
    import logging

    caplog.set_level(logging.INFO)
    path = write_chat_jsonl(tmp_path / "chat.jsonl", 8)
    args = dict(files=str(path), tokenizer=str(tokenizer_dir), seq_len=32, cache_dir=str(tmp_path / "cache"))
    first = chat_data(**args)
    assert "tokenized 8 samples into the data cache" in caplog.text
    caplog.clear()
    again = chat_data(**args, pack=False)  # packing is a view of the cached samples
    assert "reusing the data cache" in caplog.text and "tokenized" not in caplog.text.replace("tokenized again", "")
    assert [s.tokens for s in again.samples] == [s.tokens for s in first.samples]
    caplog.clear()
    write_chat_jsonl(path, 9)  # a changed file: a new cache
    assert len(chat_data(**args, pack=False)) == 9 and "tokenized 9 samples" in caplog.text
    caplog.clear()
    chat_data(**args, chat_template=MARKED_TEMPLATE)  # another template: a new cache too
    assert "tokenized 9 samples" in caplog.text
