"""A character-level corpus that needs no download: docstrings of the Python standard library.

The vocabulary is fixed (the 128 ASCII code points; anything else maps to '?') so the model's shape
does not depend on which text was read.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import os
import sys
import sysconfig
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import Dataset

from paratrain.files import write_whole

VOCAB_SIZE = 128

# A fixed list keeps the corpus the same run after run on one Python version.
STDLIB_MODULES = (
    "argparse.py",
    "collections/__init__.py",
    "dataclasses.py",
    "functools.py",
    "inspect.py",
    "json/__init__.py",
    "logging/__init__.py",
    "pathlib.py",
    "subprocess.py",
    "threading.py",
    "typing.py",
    "unittest/case.py",
    "textwrap.py",
    "shutil.py",
    "tarfile.py",
    "zipfile.py",
    "datetime.py",
    "decimal.py",
    "fractions.py",
    "statistics.py",
    "random.py",
    "heapq.py",
    "bisect.py",
    "enum.py",
    "abc.py",
    "contextlib.py",
    "tempfile.py",
    "csv.py",
    "pprint.py",
)


def stdlib_docstrings(max_chars: int) -> str:
    """Module, class and function docstrings of STDLIB_MODULES, joined, at most max_chars long: read from this
    Python's cache file (``_cache_file``) once a process wrote it. Parsing the modules was most of a worker's
    start-up on the tests' tiny GPT (67 ms of a restarted replica group's 180 ms to its quorum, and as much again
    in each worker of every launch); the file is read in well under a millisecond."""
    cache = _cache_file(max_chars)
    if cache is not None:
        with contextlib.suppress(OSError):
            return cache.read_bytes().decode("utf-8")  # bytes: no newline translation, the text as it was joined
    text = _joined_docstrings(max_chars)
    if cache is not None:
        with contextlib.suppress(OSError):  # a cache that cannot be written costs the parse next time, no more
            write_whole(cache, text)
    return text


def _joined_docstrings(max_chars: int) -> str:
    pieces: list[str] = []
    for relative in STDLIB_MODULES:
        pieces.extend(_module_docstrings(relative))
        # Parsing is most of a small run's data time: stop once the joined text is long enough.
        if sum(len(piece) + 2 for piece in pieces) >= max_chars:
            break
    return "\n\n".join(pieces)[:max_chars]


def _cache_file(max_chars: int) -> Path | None:
    """Where this interpreter's corpus of ``max_chars`` is kept: the user's cache directory (XDG_CACHE_HOME, else
    ~/.cache), under a name that changes with the Python build, its standard library and the module list; None
    where there is no home to put it in."""
    identity = f"{sys.version}|{sysconfig.get_paths()['stdlib']}|{STDLIB_MODULES}|{max_chars}"
    name = f"stdlib-docstrings-{hashlib.sha256(identity.encode()).hexdigest()[:16]}.txt"
    try:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except RuntimeError:  # Path.home() without HOME or a password entry
        return None
    return root / "paratrain" / name


@functools.cache
def _module_docstrings(relative: str) -> tuple[str, ...]:
    """Cached per process: every run in it (and its evaluation set) reads the same modules."""
    path = Path(sysconfig.get_paths()["stdlib"]) / relative
    if not path.is_file():
        return ()
    return tuple(_docstrings(path.read_text(encoding="utf-8", errors="replace")))


def _docstrings(source: str) -> list[str]:
    return [
        doc
        for node in _statements(ast.parse(source))
        if isinstance(node, _DOCUMENTED) and (doc := ast.get_docstring(node))
    ]


def _statements(tree: ast.Module) -> Iterator[ast.AST]:
    """``ast.walk``'s breadth-first order, restricted to statements and the nodes that hold them: a docstring
    is never inside an expression, and the expressions were four in five of the nodes ``ast.walk`` visited
    (most of a worker's time building the quickstart's data). Same order, so the same text."""
    queue = deque([tree])
    while queue:
        node = queue.popleft()
        queue.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, _HOLDS_STATEMENTS))
        yield node


_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_HOLDS_STATEMENTS = (ast.stmt, ast.excepthandler, ast.match_case)


def encode(text: str) -> torch.Tensor:
    """Each character's ASCII code, '?' for any other: the codec's replacement, one '?' a character (a per-
    character loop in Python took 35 ms of a worker's start-up on the tests' 40k characters)."""
    codes = bytearray(text.encode("ascii", errors="replace"))
    return torch.frombuffer(codes, dtype=torch.uint8).long() if codes else torch.zeros(0, dtype=torch.long)


class CharDataset(Dataset):
    """Non-overlapping windows of block_size + 1 characters: inputs are the first block_size, targets
    the same shifted by one."""

    vocab_size = VOCAB_SIZE  # what the shape check before training compares with the model's embedding

    def __init__(self, tokens: torch.Tensor, block_size: int):
        if len(tokens) <= block_size:
            raise ValueError(f"data.args: corpus of {len(tokens)} characters is shorter than block_size={block_size}")
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        window = self.tokens[start : start + self.block_size + 1]
        return window[:-1], window[1:]


def build_char_dataset(*, block_size: int = 64, max_chars: int = 1_000_000) -> CharDataset:
    """Factory for config files: ``data.factory: paratrain.data.text:build_char_dataset``."""
    return CharDataset(encode(stdlib_docstrings(max_chars)), block_size)
