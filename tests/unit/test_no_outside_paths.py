"""The project speaks only of itself: README.md, the docs, the examples, the packaging files and the package name no absolute
path of a machine (a virtual environment, a worktree, a scratch directory) and no path leaving the
repository (``../shared``)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = re.compile(
    r"(^|[\s`'\"(=])/(work|home|root|tmp|mnt|scratch|Users)/|\.\./shared|shared/(seeds|REFERENCE|STYLE)"
)


def checked_files() -> list[Path]:
    return [
        ROOT / "README.md",
        ROOT / "pyproject.toml",
        ROOT / "Makefile",
        *sorted(ROOT.glob("constraints*.txt")),
        *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((ROOT / "examples").rglob("*.yaml")),
        *sorted((ROOT / "paratrain").rglob("*.py")),
    ]


def outside_paths(path: Path) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if OUTSIDE.search(line)
    ]


def test_readme_docs_examples_and_package_point_nowhere_outside_the_repository():
    found = [line for path in checked_files() for line in outside_paths(path)]
    assert found == [], "\n".join(found)


def test_the_pattern_catches_machine_paths_and_the_shared_folder():
    for line in ("see ../shared/seeds/", "`/work/main/.venv/bin/python`", "cd /tmp/snap", "(/home/me/x)"):
        assert OUTSIDE.search(line), line
    for line in ("runs/quickstart", "docs/benchmarks.md", "/path/to/project", "a shared file system"):
        assert not OUTSIDE.search(line), line
