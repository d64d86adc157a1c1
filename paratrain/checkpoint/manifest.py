"""The manifest that marks a checkpoint complete and lets it be verified.

DCP writes ``.metadata`` once every rank's data is written, but a directory can still hold a
``.metadata`` from an earlier attempt, or files damaged since. So rank 0 writes
``paratrain-manifest.json`` last, atomically, after every rank finished: it lists every file with its
size and checksum (``checksums``), and carries the resolved config. No manifest, no checkpoint.

Format 2 lists xxh3-128 checksums, and its data files may hold plain tensors as raw bytes (``raw_tensors``);
format 1, each file's SHA-256 and every tensor a ``torch.save`` record, is still read and verified.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from paratrain.checkpoint.checksums import WRITTEN, algorithm_of, checksum_of_file, checksum_of_view
from paratrain.errors import CheckpointError

MANIFEST_NAME = "paratrain-manifest.json"
METADATA_NAME = ".metadata"  # DCP's own index of the checkpoint
FORMAT_VERSION = 2  # what this version writes; it reads every format up to it


class DamagedCheckpointError(CheckpointError):
    """A file of a complete checkpoint is missing, or its size or checksum is not the manifest's: the
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
        hashed: File name -> manifest entry (``checksums.entry_for``) taken as the files were written
            (``HashingWriter``); a file not in it, or whose size on disk differs, is hashed from disk.
    """
    hashed = hashed or {}
    names = sorted(path.name for path in directory.iterdir() if path.name != MANIFEST_NAME)
    files = {name: _known_or_described(directory / name, hashed.get(name)) for name in names}
    manifest = {"format": FORMAT_VERSION, "step": step, "world_size": world_size, "files": files, "config": config}
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
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"checkpoint file {path} is corrupt ({error}); use an earlier checkpoint") from None
    if manifest.get("format", 1) > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {directory} was written by a newer paratrain (manifest format {manifest['format']}; this one "
            f"reads up to {FORMAT_VERSION}): upgrade paratrain to load it"
        )
    return manifest


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

    A resume checks this much up front and leaves the data files' checksums to the load, which checks each
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
        check_bytes(metadata_path, memoryview(data), manifest["files"][METADATA_NAME])
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


def check_bytes(path: Path, data: memoryview, expected: dict[str, Any]) -> None:
    """Raises DamagedCheckpointError when ``data``, the file's bytes, do not have the manifest entry's checksum."""
    _check_checksum(path, checksum_of_view(data, _algorithm(path, expected)), expected)


def _check_checksum(path: Path, checksum: str, expected: dict[str, Any]) -> None:
    algorithm = _algorithm(path, expected)
    if checksum != expected[algorithm]:
        raise DamagedCheckpointError(
            f"checkpoint file {path} is corrupt: its {algorithm} checksum does not match the manifest; use an earlier checkpoint"
        )


def _algorithm(path: Path, expected: dict[str, Any]) -> Any:
    algorithm = algorithm_of(expected)
    if algorithm is None:
        raise DamagedCheckpointError(
            f"checkpoint file {path} is listed with no checksum this paratrain knows ({sorted(expected)}); "
            "use an earlier checkpoint, or upgrade paratrain if a newer one wrote it"
        )
    return algorithm


def verify_files(directory: Path, listed: dict[str, dict[str, Any]]) -> None:
    """Checks the size and checksum of each of ``listed`` (names in ``directory`` -> manifest entries)."""
    entries = list(listed.items())
    # Hashing releases the GIL: files are hashed in parallel, and the first bad one in order is named.
    with ThreadPoolExecutor(max_workers=min(len(entries), os.cpu_count() or 1) or 1) as pool:
        list(pool.map(lambda entry: verify_file(directory / entry[0], entry[1]), entries))


def verify_file(path: Path, expected: dict[str, Any]) -> None:
    """Raises DamagedCheckpointError when the file is missing or its size or checksum is not ``expected``'s
    (its manifest entry); a wrong size is found before any byte is read."""
    check_size(path, expected)
    _check_checksum(path, checksum_of_file(path, _algorithm(path, expected)), expected)


def _known_or_described(path: Path, known: dict[str, Any] | None) -> dict[str, Any]:
    if known is not None and known["bytes"] == path.stat().st_size:
        return known
    return _describe_file(path)


def _describe_file(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, WRITTEN: checksum_of_file(path, WRITTEN)}
