"""Tokenize once: a corpus becomes one flat on-disk token array, memory-mapped by every rank of a node.

The cache directory is named by a key over everything the tokens depend on (the files with their sizes and
modification times, the tokenizer's definition, the text field, the EOS id), so a changed input gets a new
cache and an unchanged one is reused by every later run. Block size is not in the key: packing is a view.

One process per node (local rank 0) builds it; the others wait in a collective that also carries a build
error to every rank, so a bad corpus stops all of them with the same message instead of a hang. A cache
is written into a temporary directory and renamed into place with its ``meta.json`` (token count, dtype,
BLAKE2 digest of the token bytes); a half-written, truncated or altered cache fails that check and is
rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch.distributed as dist
from tqdm import tqdm

from paratrain.data.corpus import is_saved_dataset, iter_documents
from paratrain.data.tokenizer import LoadedTokenizer
from paratrain.errors import ConfigError

logger = logging.getLogger("paratrain")

CACHE_FORMAT = 1
ENCODE_BATCH = 512  # documents per encode_batch call: enough for the tokenizer's threads to share


@dataclass(frozen=True)
class TokenArray:
    """Where a corpus' tokens are on disk and how to read them."""

    path: Path
    num_tokens: int
    dtype: str


def cache_key(files: list[Path], tokenizer: LoadedTokenizer, *, text_field: str) -> str:
    """A digest of everything the token stream depends on."""
    inputs = {
        "format": CACHE_FORMAT,
        "files": [_fingerprint(path) for path in files],
        "tokenizer": tokenizer.digest,
        "eos_id": tokenizer.eos_id,
        "text_field": text_field,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:24]


def _fingerprint(path: Path) -> list:
    parts = sorted(path.rglob("*")) if is_saved_dataset(path) else [path]
    return [[str(part.resolve()), part.stat().st_size, part.stat().st_mtime_ns] for part in parts if part.is_file()]


def build_token_array(
    files: list[Path], tokenizer: LoadedTokenizer, *, text_field: str, cache_dir: Path, local_rank: int
) -> TokenArray:
    """The corpus' token array, built by local rank 0 if no valid cache exists, shared by the node's ranks.

    Raises:
        ConfigError: on every rank, when the corpus cannot be read or holds no text.
    """
    directory = Path(cache_dir).expanduser() / cache_key(files, tokenizer, text_field=text_field)
    error = None
    if local_rank == 0:
        try:
            _maybe_build(directory, files, tokenizer, text_field=text_field)
        except ConfigError as raised:
            error = str(raised)
    error = _first_error_of_all_ranks(error)
    if error:
        raise ConfigError(error)
    meta = json.loads((directory / "meta.json").read_text())
    return TokenArray(directory / "tokens.bin", meta["num_tokens"], meta["dtype"])


def _first_error_of_all_ranks(error: str | None) -> str | None:
    """Waits for the builders; every rank learns a builder's error (the collective is the barrier)."""
    if not (dist.is_available() and dist.is_initialized()):
        return error
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


def _maybe_build(directory: Path, files: list[Path], tokenizer: LoadedTokenizer, *, text_field: str) -> None:
    problem = cache_problem(directory)
    if problem is None:
        meta = json.loads((directory / "meta.json").read_text())
        logger.info("reusing token cache %s (%d tokens, no tokenization)", directory, meta["num_tokens"])
        return
    if directory.exists():
        logger.warning("token cache %s is unusable (%s): rebuilding it", directory, problem)
    staging = directory.with_name(f"{directory.name}.partial-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _write_tokens(staging, files, tokenizer, text_field=text_field)
    shutil.rmtree(directory, ignore_errors=True)
    try:
        staging.rename(directory)
    except OSError:  # another node sharing the directory renamed its identical copy first
        shutil.rmtree(staging, ignore_errors=True)


def cache_problem(directory: Path) -> str | None:
    """Why the cache in ``directory`` cannot be used, or None when it is complete and intact."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
        tokens = directory / "tokens.bin"
        expected = meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize
        if tokens.stat().st_size != expected:
            return f"tokens.bin holds {tokens.stat().st_size} bytes, meta.json says {expected}"
        if _file_digest(tokens) != meta["blake2b"]:
            return "tokens.bin does not match its digest"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _write_tokens(staging: Path, files: list[Path], tokenizer: LoadedTokenizer, *, text_field: str) -> None:
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    digest, num_tokens, num_documents, started = hashlib.blake2b(), 0, 0, time.perf_counter()
    logger.info("tokenizing %d corpus file(s) into %s", len(files), staging.with_suffix(""))
    with (staging / "tokens.bin").open("wb") as out, tqdm(files, desc="tokenizing", unit="file", disable=None) as bar:
        for path in bar:
            for ids in _encoded_documents(path, tokenizer, text_field=text_field):
                chunk = np.asarray(ids, dtype=dtype).tobytes()
                out.write(chunk)
                digest.update(chunk)
                num_tokens, num_documents = num_tokens + len(ids), num_documents + 1
    if num_tokens == num_documents:  # only the EOS after each document, or no document at all
        raise ConfigError(
            f"data.args.files: the corpus ({', '.join(map(str, files))}) holds no text to train on; give files "
            f"that have some"
        )
    elapsed = time.perf_counter() - started
    meta = {"num_tokens": num_tokens, "dtype": np.dtype(dtype).name, "blake2b": digest.hexdigest()}
    meta.update(num_documents=num_documents, files=[str(path) for path in files])
    (staging / "meta.json").write_text(json.dumps(meta, indent=1))
    logger.info(
        "tokenized %d documents into %d tokens in %.1f s (%.0f tokens/s)",
        num_documents,
        num_tokens,
        elapsed,
        num_tokens / max(elapsed, 1e-9),
    )


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


def _file_digest(path: Path) -> str:
    digest = hashlib.blake2b()
    with path.open("rb") as tokens:
        while chunk := tokens.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
