"""Packed language-modelling data on a hand-made corpus: packing, the token cache, and bad input."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from paratrain.data.lm import packed_text
from paratrain.data.shared_cache import cache_problem
from paratrain.errors import ConfigError

WORDS = [f"w{i}" for i in range(40)]
EOS = "<|endoftext|>"
DOCS = [" ".join(WORDS[i : i + 3 + i % 7]) for i in range(30)]  # documents of 3 to 9 words


def word_tokenizer(path: Path, words=WORDS) -> Path:
    """One token per word: token counts are word counts."""
    vocab = {EOS: 0, "<unk>": 1, **{word: i + 2 for i, word in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return path


def ids(document: str) -> list[int]:
    return [WORDS.index(word) + 2 for word in document.split()]


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "docs").mkdir()
    for i, doc in enumerate(DOCS[:10]):
        (tmp_path / "docs" / f"{i:02d}.txt").write_text(doc)
    (tmp_path / "more.jsonl").write_text("".join(json.dumps({"text": doc, "id": 1}) + "\n" for doc in DOCS[10:]))
    return {
        "files": [str(tmp_path / "docs"), str(tmp_path / "more.jsonl")],
        "tokenizer": str(word_tokenizer(tmp_path / "tok.json")),
        "cache_dir": str(tmp_path / "cache"),
    }


def test_packing_conserves_tokens_separates_documents_by_eos_and_shifts_targets_by_one(corpus):
    dataset = packed_text(**corpus, block_size=8)
    stream = [token for doc in DOCS for token in [*ids(doc), 0]]
    assert dataset.tokens.num_tokens == len(stream) == sum(len(doc.split()) + 1 for doc in DOCS)
    assert len(dataset) == (len(stream) - 1) // 8
    read = []
    for i in range(len(dataset)):
        inputs, targets = dataset[i]
        assert inputs.dtype == torch.long and inputs.shape == targets.shape == (8,)
        assert torch.equal(targets[:-1], inputs[1:])
        read.extend(inputs.tolist())
        assert targets[-1].item() == stream[8 * i + 8]
    assert read == stream[: 8 * len(dataset)]
    assert read.count(0) == stream[: len(read)].count(0)  # an EOS after every document, nothing else


def test_parquet_and_saved_dataset_give_the_same_tokens_as_jsonl(tmp_path, corpus):
    import datasets

    table = datasets.Dataset.from_dict({"text": DOCS[10:]})
    table.to_parquet(str(tmp_path / "more.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    reference = packed_text(**corpus, block_size=4).array.tolist()
    for other in ("more.parquet", "saved"):
        args = {**corpus, "files": [corpus["files"][0], str(tmp_path / other)]}
        assert packed_text(**args, block_size=4).array.tolist() == reference


def test_validation_split_holds_out_the_last_samples(corpus):
    whole = packed_text(**corpus, block_size=4)
    train = packed_text(**corpus, block_size=4, validation_fraction=0.25)
    valid = packed_text(**corpus, block_size=4, split="validation", validation_fraction=0.25)
    assert len(train) + len(valid) == len(whole) and len(valid) == int(len(whole) * 0.25)
    assert torch.equal(valid[0][0], whole[len(train)][0])


def test_second_build_reuses_the_cache_and_a_corrupted_or_partial_one_is_rebuilt(corpus, caplog):
    caplog.set_level(logging.INFO, logger="paratrain")
    first = packed_text(**corpus, block_size=8)
    assert "tokenizing 11 corpus file(s)" in caplog.text
    expected = first.array.tolist()
    caplog.clear()
    packed_text(**corpus, block_size=16)  # another block size packs the same cached tokens
    assert "reusing the data cache" in caplog.text and "tokenizing" not in caplog.text

    directory = first.tokens.path.parent
    raw = bytearray(first.tokens.path.read_bytes())
    raw[10] ^= 0xFF
    first.tokens.path.write_bytes(bytes(raw))  # same size, altered content
    assert cache_problem(directory) == "tokens.bin does not match its digest"
    caplog.clear()
    assert packed_text(**corpus, block_size=8).array.tolist() == expected
    assert "is unusable" in caplog.text and "tokenizing" in caplog.text

    first.tokens.path.write_bytes(first.tokens.path.read_bytes()[:-6])  # a truncated write
    assert "meta.json says" in cache_problem(directory)
    (directory / "meta.json").unlink()  # killed before meta.json
    assert packed_text(**corpus, block_size=8).array.tolist() == expected
    assert cache_problem(directory) is None


def test_a_changed_file_gets_a_new_cache(corpus, tmp_path):
    before = packed_text(**corpus, block_size=4)
    (tmp_path / "docs" / "00.txt").write_text("w1 w2 w3 w4 w5 w6")
    after = packed_text(**corpus, block_size=4)
    assert after.tokens.path != before.tokens.path and after.tokens.num_tokens == before.tokens.num_tokens + 3


def test_workers_reopen_the_map_instead_of_pickling_the_tokens(corpus):
    import pickle

    dataset = packed_text(**corpus, block_size=8)
    dataset[0]
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy._array is None and torch.equal(copy[3][0], dataset[3][0])


@pytest.mark.parametrize(
    "change,message",
    [
        ({"files": ["missing/*.txt"]}, "data.args.files: 'missing/*.txt' matches no file"),
        ({"tokenizer": "nowhere"}, "data.args.tokenizer='nowhere' is not a tokenizer"),
        ({"eos_token": "<nope>"}, "data.args.eos_token='<nope>'"),
        ({"block_size": 0}, "data.args.block_size=0"),
        ({"split": "validation"}, "data.args.validation_fraction=0.0"),
        ({"block_size": 1000}, "make no train sample of block_size=1000"),
    ],
)
def test_bad_arguments_name_the_key(corpus, change, message):
    with pytest.raises(ConfigError, match=None) as error:
        packed_text(**{**corpus, "block_size": 8, **change})
    assert message in str(error.value)


def test_a_json_line_without_the_text_field_names_file_and_line(corpus, tmp_path):
    (tmp_path / "more.jsonl").write_text('{"text": "w1 w2"}\n\n{"body": "w3"}\n')
    with pytest.raises(ConfigError) as error:
        packed_text(**corpus, block_size=2)
    assert f"{tmp_path / 'more.jsonl'}:3 has no string field 'text'" in str(error.value)


def test_a_file_that_is_not_a_tokenizer_is_refused(corpus, tmp_path):
    (tmp_path / "bad.json").write_text('{"hello": 1}')
    with pytest.raises(ConfigError, match="is not a tokenizer"):
        packed_text(**{**corpus, "tokenizer": str(tmp_path / "bad.json")}, block_size=8)


def test_an_empty_corpus_is_refused(corpus, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="holds no text"):
        packed_text(**{**corpus, "files": str(tmp_path / "empty.txt")}, block_size=8)


class RecordingReads(torch.utils.data.Dataset):
    """The packed dataset, noting which samples were read (in this process: the loader runs without workers)."""

    def __init__(self, dataset):
        self.dataset, self.reads = dataset, []

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        self.reads.append(index)
        return self.dataset[index]


def read_steps(dataset, position, *, dp_size, steps, global_batch=8, micro=2):
    """Every rank's StepBatches from ``position`` for ``steps`` steps; returns the advanced position."""
    from paratrain.data.loader import StepBatches
    from paratrain.data.sampler import DataPosition, GlobalBatchSampler

    for rank in range(dp_size):
        sampler = GlobalBatchSampler(len(dataset), global_batch, micro, rank, dp_size, seed=3)
        batches = StepBatches(dataset, sampler, start=position, num_workers=0, pin_memory=False)
        for _ in range(steps):
            next(batches)
    moved = DataPosition()
    moved.load_state_dict(position.state_dict())  # what a checkpoint carries to the next run
    for _ in range(steps):
        moved.advance(sampler.batches_per_epoch)
    return moved


@pytest.mark.parametrize("before,after", [(2, 4), (4, 1)])
def test_resume_on_another_data_parallel_size_reads_every_sample_of_the_epoch_once(corpus, before, after):
    from paratrain.data.sampler import DataPosition

    dataset = RecordingReads(packed_text(**corpus, block_size=2))
    batches_per_epoch = len(dataset) // 8
    assert batches_per_epoch >= 6
    position = read_steps(dataset, DataPosition(), dp_size=before, steps=3)
    position = read_steps(dataset, position, dp_size=after, steps=batches_per_epoch - 3)
    assert (position.epoch, position.batch_in_epoch) == (1, 0)
    assert len(dataset.reads) == len(set(dataset.reads)) == batches_per_epoch * 8


def test_loader_workers_with_prefetch_and_persistence_hand_out_the_same_batches_as_the_training_process(corpus):
    from paratrain.data.loader import StepBatches
    from paratrain.data.sampler import DataPosition, GlobalBatchSampler

    dataset = packed_text(**corpus, block_size=4)
    sampler = GlobalBatchSampler(len(dataset), 8, 2, 1, 2, seed=0)
    start = DataPosition(epoch=0, batch_in_epoch=1)
    options = {"num_workers": 2, "prefetch_factor": 4, "persistent_workers": True}
    batches = [
        StepBatches(dataset, sampler, start=start, pin_memory=False, **kw) for kw in ({"num_workers": 0}, options)
    ]
    for _ in range(5):
        plain, with_workers = (next(b) for b in batches)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(plain, with_workers))
