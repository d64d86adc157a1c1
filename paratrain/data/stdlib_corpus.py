"""The example corpus and tokenizer, made locally in seconds: nothing is downloaded.

``python -m paratrain.data.stdlib_corpus DIR`` writes ``DIR/corpus.jsonl`` (one document per docstring of
the Python standard library modules in paratrain.data.text) and ``DIR/tokenizer.json``, a byte-level BPE
tokenizer trained on it with the ``tokenizers`` library, whose EOS is ``<|endoftext|>``.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

from paratrain.data.text import STDLIB_MODULES, _docstrings

EOS = "<|endoftext|>"


def write_stdlib_corpus(path: Path, *, min_chars: int = 40) -> int:
    """Writes the docstrings as JSON lines {"text": ...}; returns how many."""
    root = Path(sysconfig.get_paths()["stdlib"])
    documents = [
        doc
        for relative in STDLIB_MODULES
        if (root / relative).is_file()
        for doc in _docstrings((root / relative).read_text(encoding="utf-8", errors="replace"))
        if len(doc) >= min_chars
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in documents))
    return len(documents)


def train_tokenizer(corpus: Path, path: Path, *, vocab_size: int = 1024) -> None:
    """A byte-level BPE tokenizer (any text encodes, no unknown token) trained on the corpus' texts."""
    # Lazy: an optional dependency, imported only where it is used.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (json.loads(line)["text"] for line in corpus.read_text().splitlines())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(path))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--vocab-size", type=int, default=1024)
    args = parser.parse_args(argv)
    count = write_stdlib_corpus(args.directory / "corpus.jsonl")
    train_tokenizer(args.directory / "corpus.jsonl", args.directory / "tokenizer.json", vocab_size=args.vocab_size)
    print(f"wrote {count} documents to {args.directory / 'corpus.jsonl'} and {args.directory / 'tokenizer.json'}")


if __name__ == "__main__":
    main()
