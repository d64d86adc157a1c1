"""Bad token data fails before training through the CLI: exit code 2, the key and the fix, no traceback."""

from __future__ import annotations

import json

import pytest

from tests.harness import run_cli_in_process, tiny_config, write_config
from tests.unit.test_lm_data import DOCS, word_tokenizer


@pytest.fixture
def packed(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in DOCS))
    args = {"files": str(corpus), "tokenizer": str(word_tokenizer(tmp_path / "tok.json")), "block_size": 8}
    return {"factory": "paratrain.data.lm:packed_text", "args": {**args, "cache_dir": str(tmp_path / "cache")}}


def fails_before_training(tmp_path, config, *expected):
    path = write_config(tmp_path / "config.yaml", config)
    code, stderr = run_cli_in_process(["train", str(path)])
    assert code == 2 and "Traceback" not in stderr, stderr
    for text in expected:
        assert text in stderr, stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_tokenizer_larger_than_the_model_embedding_is_refused_before_training(tmp_path, packed):
    config = tiny_config(tmp_path / "run", data=packed, model={"args": {"vocab_size": 16, "block_size": 16}})
    fails_before_training(tmp_path, config, "has 42 tokens but the model embeds 16", "model.args.vocab_size")


def test_a_corpus_smaller_than_one_global_batch_is_refused_before_training(tmp_path, packed):
    model = {"args": {"vocab_size": 64, "block_size": 16}}
    config = tiny_config(tmp_path / "run", data=packed, model=model, train={"global_batch_size": 64})
    fails_before_training(tmp_path, config, "train.global_batch_size=64 is larger than the dataset (25 samples)")


def test_a_json_line_without_the_text_field_is_refused_naming_file_and_line(tmp_path, packed):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(corpus.read_text() + '{"content": "w1"}\n')
    model = {"args": {"vocab_size": 64, "block_size": 16}}
    fails_before_training(
        tmp_path, tiny_config(tmp_path / "run", data=packed, model=model), f"{corpus}:{len(DOCS) + 1} has no string"
    )
