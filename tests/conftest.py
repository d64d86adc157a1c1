"""Options of the whole suite."""

from __future__ import annotations


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--rewrite-golden",
        action="store_true",
        help="rewrite tests/assets/losses/ from this run instead of comparing with it (after a deliberate change)",
    )
