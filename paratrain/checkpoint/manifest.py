"""The manifest that marks a checkpoint complete and lets it be verified.

DCP writes ``.metadata`` once every rank's data is written, but a directory can still hold a
``.metadata`` from an earlier attempt, or files damaged since. So rank 0 writes
``paratrain-manifest.json`` last, atomically, after every rank finished: it lists every file with its
size and SHA-256, and carries the resolved config. No manifest, no checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from paratrain.errors import CheckpointError

MANIFEST_NAME = "paratrain-manifest.json"
METADATA_NAME = ".metadata"  # DCP's own index of the checkpoint
_FORMAT_VERSION = 1


class DamagedCheckpointError(CheckpointError):
    """A file of a complete checkpoint is missing, or its size or SHA-256 is not the manifest's: the
    checkpoint must not be loaded, and ``resume: auto`` falls back to an earlier one."""


_STEP_DIR = re.compile(r"^step-(\d+)$")


def find_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step-<N> directory, complete or not, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def named_checkpoint(path: Path) -> Path:
    """The checkpoint a command-line argument names: a step-<N> directory itself, or a run's output directory
    (or its checkpoints/ directory) for its newest complete checkpoint, so a command need not know the last step.
    Anything else is returned as given, for ``verify_checkpoint`` to say what is wrong with it."""
    path = Path(path)
    if _STEP_DIR.match(path.name) or is_complete(path):
        return path
    for directory in (path / "checkpoints", path):
        complete = [step_dir for _, step_dir in reversed(find_checkpoints(directory)) if is_complete(step_dir)]
        if complete:
            return complete[0]
    return path


def write_manifest(
    directory: Path,
    *,
    step: int,
    config: dict[str, Any],
    world_size: int,
    weights_finite: bool | None = None,
    hashed: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Marks ``directory`` complete.

    Args:
        directory: The checkpoint, every rank's files written and synced.
        step: Recorded.
        config: The resolved config, recorded.
        world_size: Recorded.
        weights_finite: Whether the saved weights were checked finite on every rank (None: not
            checked, as by tools that copy checkpoints).
        hashed: File name -> ``{"bytes", "sha256"}`` taken as the files were written
            (``HashingWriter``); a file not in it, or whose size on disk differs, is hashed from disk.
    """
    hashed = hashed or {}
    names = sorted(path.name for path in directory.iterdir() if path.name != MANIFEST_NAME)
    files = {name: _known_or_described(directory / name, hashed.get(name)) for name in names}
    manifest = {"format": _FORMAT_VERSION, "step": step, "world_size": world_size, "files": files, "config": config}
    if weights_finite is not None:
        manifest["weights_finite"] = weights_finite
    tmp = directory / (MANIFEST_NAME + ".tmp")
    with open(tmp, "w") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, directory / MANIFEST_NAME)


def is_complete(directory: Path) -> bool:
    return (directory / MANIFEST_NAME).is_file()


def read_manifest(directory: Path) -> dict[str, Any]:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} does not exist; pass an existing step-<N> directory")
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointError(
            f"{directory} is not a complete checkpoint: {MANIFEST_NAME} is missing (the save did not finish)"
        )
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"checkpoint file {path} is corrupt ({error}); use an earlier checkpoint") from None


def verify_checkpoint(directory: Path) -> dict[str, Any]:
    """Checks every listed file's size and checksum; returns the manifest.

    Raises:
        CheckpointError: naming the first file that is missing, truncated or altered.
    """
    directory = Path(directory)
    manifest = check_checkpoint(directory)  # a missing or truncated file is named before any byte is hashed
    verify_files(directory, manifest["files"])
    return manifest


def check_checkpoint(directory: Path) -> dict[str, Any]:
    """What can be checked without reading the data: the manifest, every listed file's presence and size,
    and DCP's ``.metadata`` (small: hashed, then read by the restricted unpickler); returns the manifest.

    A resume checks this much up front and leaves the data files' SHA-256 to the load, which checks each
    file as it reads it (``VerifyingReader``): one pass over the bytes instead of two.

    Raises:
        CheckpointError: naming the first file that is missing, truncated or altered, or metadata that is
            not DCP's.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(
            f"checkpoint {directory} does not exist; pass an existing step-<N> directory or checkpoint.resume=auto"
        )
    manifest = read_manifest(directory)
    for name, expected in manifest["files"].items():
        check_size(directory / name, expected)
    metadata_path = directory / METADATA_NAME
    if not metadata_path.is_file():
        raise DamagedCheckpointError(f"checkpoint file {metadata_path} is missing; use an earlier checkpoint")
    data = metadata_path.read_bytes()
    if METADATA_NAME in manifest["files"]:
        check_sha256(metadata_path, hashlib.sha256(data).hexdigest(), manifest["files"][METADATA_NAME])
    # Lazy: it loads torch.distributed.checkpoint, a second at every CLI start otherwise.
    from paratrain.checkpoint.safe_reader import load_metadata_safely

    load_metadata_safely(data, path=str(metadata_path))  # refuses planted pickles
    return manifest


def check_size(path: Path, expected: dict[str, Any], *, size: int | None = None) -> None:
    """Raises DamagedCheckpointError when the file is missing or its size (``size``, the bytes read from it,
    else its size on disk) is not the manifest's."""
    if size is None and not path.is_file():
        raise DamagedCheckpointError(f"checkpoint file {path} is missing; use an earlier checkpoint")
    size = path.stat().st_size if size is None else size
    if size != expected["bytes"]:
        raise DamagedCheckpointError(
            f"checkpoint file {path} is truncated or altered: {size} bytes, expected {expected['bytes']}; use an earlier checkpoint"
        )


def check_sha256(path: Path, sha256: str, expected: dict[str, Any]) -> None:
    """Raises DamagedCheckpointError when ``sha256``, taken of the file's bytes, is not the manifest's."""
    if sha256 != expected["sha256"]:
        raise DamagedCheckpointError(
            f"checkpoint file {path} is corrupt: its SHA-256 does not match the manifest; use an earlier checkpoint"
        )


def verify_files(directory: Path, listed: dict[str, dict[str, Any]]) -> None:
    """Checks the size and SHA-256 of each of ``listed`` (names in ``directory`` -> manifest entries)."""
    entries = list(listed.items())
    # hashlib releases the GIL: files are hashed in parallel, and the first bad one in order is named.
    with ThreadPoolExecutor(max_workers=min(len(entries), os.cpu_count() or 1) or 1) as pool:
        list(pool.map(lambda entry: verify_file(directory / entry[0], entry[1]), entries))


def verify_file(path: Path, expected: dict[str, Any]) -> None:
    """Raises DamagedCheckpointError when the file is missing or its size or SHA-256 is not ``expected``'s
    (its manifest entry); a wrong size is found before any byte is read."""
    check_size(path, expected)
    check_sha256(path, _sha256(path), expected)


def _known_or_described(path: Path, known: dict[str, Any] | None) -> dict[str, Any]:
    if known is not None and known["bytes"] == path.stat().st_size:
        return known
    return _describe_file(path)


def _describe_file(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


_READ_CHUNK = 8 << 20  # large sequential reads: a cold file streams at the disk's rate, not in 256 KiB steps


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(_READ_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        if hasattr(os, "posix_fadvise"):  # Linux: a larger read-ahead window
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while count := handle.readinto(buffer):
            digest.update(view[:count])  # releases the GIL: other files hash in parallel meanwhile
    return digest.hexdigest()
