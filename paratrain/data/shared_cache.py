"""Data prepared once (tokenized corpora, tokenized chat and preference samples) and reused by every later run.

A cache directory is named by a key over everything its contents depend on (``cache_key``: the files with
their sizes and modification times, the tokenizer's definition, the settings), so a changed input gets a new
directory and an unchanged one is reused. One process per node (local rank 0) builds it; the others wait in a
collective that also carries a build error to every rank, so bad data stops all of them with the same
message instead of a hang. It is written into a temporary directory and renamed into place with its
``meta.json``, which lists every file's size and BLAKE2 digest: a half-written, truncated or altered cache
fails that check and is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from paratrain.data.corpus import is_saved_dataset
from paratrain.errors import ConfigError

logger = logging.getLogger("paratrain")

META = "meta.json"
DEFAULT_CACHE_DIR = "~/.cache/paratrain/tokens"


def cache_key(inputs: dict[str, Any]) -> str:
    """A digest of everything a cache's contents depend on (JSON-able values)."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:24]


def fingerprint(path: Path) -> list:
    """What identifies a data file (or a saved dataset's files) without reading it: names, sizes, times."""
    parts = sorted(path.rglob("*")) if is_saved_dataset(path) else [path]
    return [[str(part.resolve()), part.stat().st_size, part.stat().st_mtime_ns] for part in parts if part.is_file()]


def directory_digest(directory: Path) -> str:
    """A digest of every file in a directory (a tokenizer saved with save_pretrained), by name and content."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(directory).expanduser().rglob("*") if p.is_file()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def shared_cache(directory: Path, build: Callable[[Path], dict[str, Any]], *, local_rank: int) -> dict[str, Any]:
    """The cache in ``directory``, built by ``build(staging)`` on local rank 0 when none is intact there;
    returns its meta (what ``build`` returned, beside the files' digests).

    Args:
        build: Writes the cache's files into the directory it is given and returns what its meta records.

    Raises:
        ConfigError: on every rank, when the build raised one (bad data) on any rank.
    """
    error = None
    if local_rank == 0:
        try:
            _maybe_build(directory, build)
        except ConfigError as raised:
            error = str(raised)
    error = _first_error_of_all_ranks(error)
    if error:
        raise ConfigError(error)
    return json.loads((directory / META).read_text())


def cache_problem(directory: Path) -> str | None:
    """Why the cache in ``directory`` cannot be used, or None when it is complete and intact."""
    try:
        meta = json.loads((directory / META).read_text())
        for name, expected in meta["digests"].items():
            path = directory / name
            if path.stat().st_size != expected["bytes"]:
                return f"{name} holds {path.stat().st_size} bytes, meta.json says {expected['bytes']}"
            if _file_digest(path) != expected["blake2b"]:
                return f"{name} does not match its digest"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _maybe_build(directory: Path, build: Callable[[Path], dict[str, Any]]) -> None:
    problem = cache_problem(directory)
    if problem is None:
        logger.info("reusing the data cache %s (nothing tokenized again)", directory)
        return
    if directory.exists():
        logger.warning("data cache %s is unusable (%s): rebuilding it", directory, problem)
    staging = directory.with_name(f"{directory.name}.partial-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    meta = build(staging)
    files = sorted(path for path in staging.iterdir() if path.is_file())
    meta["digests"] = {path.name: {"bytes": path.stat().st_size, "blake2b": _file_digest(path)} for path in files}
    (staging / META).write_text(json.dumps(meta, indent=1))
    shutil.rmtree(directory, ignore_errors=True)
    try:
        staging.rename(directory)
    except OSError:  # another node sharing the directory renamed its identical copy first
        shutil.rmtree(staging, ignore_errors=True)


def _first_error_of_all_ranks(error: str | None) -> str | None:
    """Waits for the builders; every rank learns a builder's error (the collective is the barrier)."""
    if not (dist.is_available() and dist.is_initialized()):
        return error
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


def _file_digest(path: Path) -> str:
    digest = hashlib.blake2b()
    with path.open("rb") as stream:
        while chunk := stream.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
