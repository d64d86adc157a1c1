"""Tokenize once: a corpus becomes one flat on-disk token array, memory-mapped by every rank of a node.

The array is a shared cache (paratrain.data.shared_cache): keyed by the files with their sizes and
modification times, the tokenizer's definition, the text field and the EOS id, built by one process per node,
checked against its digest before use. Block size is not in the key: packing is a view.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from paratrain.data.corpus import iter_documents
from paratrain.data.shared_cache import cache_key, fingerprint, shared_cache
from paratrain.data.tokenizer import LoadedTokenizer
from paratrain.errors import ConfigError

logger = logging.getLogger("paratrain")

CACHE_FORMAT = 2  # 2: meta.json lists each file's digest (data/shared_cache.py)
ENCODE_BATCH = 512  # documents per encode_batch call: enough for the tokenizer's threads to share


@dataclass(frozen=True)
class TokenArray:
    """Where a corpus' tokens are on disk and how to read them."""

    path: Path
    num_tokens: int
    dtype: str


def token_cache_key(files: list[Path], tokenizer: LoadedTokenizer, *, text_field: str) -> str:
    """A digest of everything the token stream depends on."""
    return cache_key(
        {
            "format": CACHE_FORMAT,
            "files": [fingerprint(path) for path in files],
            "tokenizer": tokenizer.digest,
            "eos_id": tokenizer.eos_id,
            "text_field": text_field,
        }
    )


def build_token_array(
    files: list[Path], tokenizer: LoadedTokenizer, *, text_field: str, cache_dir: Path, local_rank: int
) -> TokenArray:
    """The corpus' token array, built by local rank 0 if no valid cache exists, shared by the node's ranks.

    Raises:
        ConfigError: on every rank, when the corpus cannot be read or holds no text.
    """
    directory = Path(cache_dir).expanduser() / token_cache_key(files, tokenizer, text_field=text_field)
    meta = shared_cache(
        directory,
        lambda staging: _write_tokens(staging, files, tokenizer, text_field=text_field),
        local_rank=local_rank,
    )
    return TokenArray(directory / "tokens.bin", meta["num_tokens"], meta["dtype"])


def _write_tokens(staging: Path, files: list[Path], tokenizer: LoadedTokenizer, *, text_field: str) -> dict:
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    num_tokens, num_documents, started = 0, 0, time.perf_counter()
    logger.info("tokenizing %d corpus file(s) into %s", len(files), staging.with_suffix(""))
    with (staging / "tokens.bin").open("wb") as out, tqdm(files, desc="tokenizing", unit="file", disable=None) as bar:
        for path in bar:
            for ids in _encoded_documents(path, tokenizer, text_field=text_field):
                out.write(np.asarray(ids, dtype=dtype).tobytes())
                num_tokens, num_documents = num_tokens + len(ids), num_documents + 1
    if num_tokens == num_documents:  # only the EOS after each document, or no document at all
        raise ConfigError(
            f"data.args.files: the corpus ({', '.join(map(str, files))}) holds no text to train on; give files "
            f"that have some"
        )
    elapsed = time.perf_counter() - started
    logger.info(
        "tokenized %d documents into %d tokens in %.1f s (%.0f tokens/s)",
        num_documents,
        num_tokens,
        elapsed,
        num_tokens / max(elapsed, 1e-9),
    )
    return {
        "num_tokens": num_tokens,
        "dtype": np.dtype(dtype).name,
        "num_documents": num_documents,
        "corpus": [str(path) for path in files],
    }


def _encoded_documents(path: Path, tokenizer: LoadedTokenizer, *, text_field: str):
    """Token ids of each document of ``path``, EOS appended; encoded in batches on the tokenizer's threads."""
    batch: list[str] = []
    for document in iter_documents(path, text_field=text_field):
        batch.append(document)
        if len(batch) == ENCODE_BATCH:
            yield from _encode(batch, tokenizer)
            batch = []
    if batch:
        yield from _encode(batch, tokenizer)


def _encode(documents: list[str], tokenizer: LoadedTokenizer):
    # Special tokens (a BOS a post-processor would add) stay out: documents are separated by EOS alone.
    for encoding in tokenizer.tokenizer.encode_batch(documents, add_special_tokens=False):
        yield [*encoding.ids, tokenizer.eos_id]
