"""The checksums a manifest lists for each checkpoint file: xxh3-128 for every file written now, SHA-256 still
checked in checkpoints written before.

They guard against corruption (a truncated copy, a flipped bit, a file changed since the save), not against
someone who can write the checkpoint directory (docs/checkpoints.md, trust model): such a person could rewrite
the manifest too, whatever the hash. So the hash is chosen for speed at that job. xxh3-128 hashes about
20 GB/s on one core of the benchmark machine, where SHA-256 reached 1.2-1.7 GB/s and took 0.75 CPU-s per
0.93 GB saved, and again on every load and export; 128 bits make an accidental match of a damaged file
negligible.

Each manifest entry names its algorithm by its key, ``{"bytes": n, "xxh3_128": hex}`` (manifest format 2) or
``{"bytes": n, "sha256": hex}`` (format 1), so a checkpoint keeps verifying with the algorithm it was written
with.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Literal

import xxhash

Algorithm = Literal["xxh3_128", "sha256"]
WRITTEN: Algorithm = "xxh3_128"  # what new manifests list
_CONSTRUCTORS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
_CHUNK = 8 << 20  # large sequential reads: a cold file streams at the disk's rate, not in 256 KiB steps


def new_digest(algorithm: Algorithm = WRITTEN) -> Any:
    """A fresh hash object of ``algorithm`` (``update``, ``hexdigest``)."""
    return _CONSTRUCTORS[algorithm]()


def algorithm_of(entry: dict[str, Any]) -> Algorithm | None:
    """The algorithm a manifest entry lists its checksum under, or None when it lists none this version knows."""
    return next((name for name in _CONSTRUCTORS if name in entry), None)  # type: ignore[return-value]


def entry_for(size: int, digest: Any) -> dict[str, Any]:
    """The manifest entry of a file of ``size`` bytes whose bytes went through ``digest`` (from ``new_digest()``)."""
    return {"bytes": size, WRITTEN: digest.hexdigest()}


def checksum_of_view(data: memoryview, algorithm: Algorithm) -> str:
    """The checksum of bytes in memory, a slice at a time: each update releases the GIL, so another file is
    hashed or served meanwhile."""
    digest = new_digest(algorithm)
    for start in range(0, len(data), _CHUNK):
        digest.update(data[start : start + _CHUNK])
    return digest.hexdigest()


def checksum_of_file(path: Path, algorithm: Algorithm) -> str:
    """The checksum of a file's bytes, read in large sequential reads."""
    digest = new_digest(algorithm)
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        if hasattr(os, "posix_fadvise"):  # Linux: a larger read-ahead window
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while count := handle.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()
