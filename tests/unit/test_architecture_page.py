"""docs/architecture.md cannot drift from the code: its layer table lists the packages and modules of
``LAYERS`` (the order the import test enforces), in that order, and every module path it names exists."""

from __future__ import annotations

import re

from tests.unit.test_import_graph import LAYERS, PACKAGE

PAGE = PACKAGE.parent / "docs" / "architecture.md"


def layer_table_names(page: str) -> list[str]:
    """The first column of the table under "## Layering", its backticked names in reading order, a package's
    trailing slash dropped: ``| `config/` | ...`` -> ``config``."""
    section = page.split("## Layering", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [name.rstrip("/") for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[1])]


def named_module_paths(page: str) -> set[str]:
    """Every ``pkg/module.py`` the page names."""
    return set(re.findall(r"\b([a-z_]+(?:/[a-z_]+)*/[a-z_]+\.py)\b", page))


def test_the_layer_table_is_the_import_tests_order():
    assert layer_table_names(PAGE.read_text()) == list(LAYERS)


def test_every_module_the_page_names_exists():
    root = PACKAGE.parent
    missing = sorted(
        path
        for path in named_module_paths(PAGE.read_text())
        if not (PACKAGE / path).exists() and not (root / path).exists()
    )
    assert missing == []


def test_the_table_reader_sees_a_reordered_or_missing_row():
    """The reader is not vacuous: a swapped row, or a row left out, changes what it returns."""
    page = PAGE.read_text()
    assert layer_table_names(page)[:2] == ["errors", "tensors"]
    swapped = page.replace("| `config/` |", "| `models_swapped/` |", 1)
    assert layer_table_names(swapped) != list(LAYERS)
    assert "tests/unit/test_import_graph.py" in named_module_paths(page)
