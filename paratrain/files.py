"""Writing a small file whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


def write_whole(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` whole or not at all, its directory made if missing: a reader sees the old file or
    the new one, never a part, and several processes may write it at once (each through a file of its own, then one
    atomic rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)
