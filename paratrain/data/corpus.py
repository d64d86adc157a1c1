"""Documents from local files: plain text, JSON lines, parquet, or a 🤗 ``datasets`` dataset saved to disk.

A ``.txt`` file is one document. A ``.jsonl`` line and a parquet or ``datasets`` row is one document, read
from its ``text_field``. Files are read in the order given (directories and globs sorted), so the token
stream, and with it every sample, is the same run after run.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError

SUFFIXES = (".txt", ".jsonl", ".parquet")


def resolve_files(files: str | list[str], *, key: str = "data.args.files") -> list[Path]:
    """The corpus files (and saved ``datasets`` directories) that ``files`` names, in a fixed order.

    Raises:
        ConfigError: a path or glob matches nothing, or names a file of a kind this reader does not know.
    """
    resolved: list[Path] = []
    for pattern in [files] if isinstance(files, str) else files:
        matches = sorted(Path(match) for match in glob.glob(str(Path(pattern).expanduser())))
        if not matches:
            raise ConfigError(f"{key}: {pattern!r} matches no file; give an existing file, directory or glob")
        resolved.extend(path for match in matches for path in _expand(match, key=key))
    return resolved


def _expand(path: Path, *, key: str) -> list[Path]:
    if is_saved_dataset(path):
        return [path]
    if path.is_dir():
        return sorted(child for child in path.rglob("*") if child.suffix in SUFFIXES and child.is_file())
    if path.suffix not in SUFFIXES:
        raise ConfigError(
            f"{key}: {str(path)!r} is not a corpus file; use .txt, .jsonl, .parquet or a directory saved by "
            f"datasets' save_to_disk"
        )
    return [path]


def is_saved_dataset(path: Path) -> bool:
    """A directory written by ``datasets.Dataset.save_to_disk``."""
    return path.is_dir() and (path / "dataset_info.json").is_file() and (path / "state.json").is_file()


def iter_documents(path: Path, *, text_field: str) -> Iterator[str]:
    """The documents of one corpus file, in order.

    Raises:
        ConfigError: a JSON line is not an object with a string ``text_field`` (file and line named), or a
            table has no such column.
    """
    if path.suffix == ".txt":
        yield path.read_text(encoding="utf-8", errors="replace")
    elif path.suffix == ".jsonl":
        yield from _jsonl_documents(path, text_field)
    elif path.suffix == ".parquet":
        yield from _parquet_documents(path, text_field)
    else:
        yield from _saved_dataset_documents(path, text_field)


def jsonl_values(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line of a JSONL file.

    Raises:
        ConfigError: a line that is not valid JSON, naming the file and line.
    """
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"data: {path}:{number} is not valid JSON ({error.msg})") from None


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    for number, record in jsonl_values(path):
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise ConfigError(
                f"data.args.text_field={text_field!r}: {path}:{number} has no string field {text_field!r}; "
                f"fix the line or name the field that holds the text"
            )
        yield record[text_field]


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    # Lazy: an optional dependency, imported only where it is used.
    import pyarrow.parquet as pq  # comes with the data extra (datasets); only parquet corpora need it

    parquet = pq.ParquetFile(path)
    _check_column(parquet.schema_arrow.names, text_field, path)
    for batch in parquet.iter_batches(columns=[text_field], batch_size=1024):
        yield from (text or "" for text in batch.column(0).to_pylist())


def _saved_dataset_documents(path: Path, text_field: str) -> Iterator[str]:
    # Lazy: an optional dependency, imported only where it is used.
    import datasets  # the data extra; imported only for saved datasets (it takes a second to import)

    dataset = datasets.load_from_disk(str(path))
    _check_column(dataset.column_names, text_field, path)
    for batch in dataset.iter(batch_size=1024):
        yield from (text or "" for text in batch[text_field])


def _check_column(columns: list[str], text_field: str, path: Path) -> None:
    if text_field not in columns:
        raise ConfigError(
            f"data.args.text_field={text_field!r}: {path} has no column {text_field!r} (columns: "
            f"{', '.join(columns)}); name the column that holds the text"
        )
