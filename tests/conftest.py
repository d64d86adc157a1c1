"""Options of the whole suite."""

from __future__ import annotations


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--rewrite-golden",
        action="store_true",
        help="rewrite tests/assets/losses/ from this run instead of comparing with it (after a deliberate change)",
    )
    parser.addoption(
        "--gpu-device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="where the gpu-marked tests (tests/gpu/) run: cuda (skipped below the GPUs each needs), or cpu "
        "with gloo, which checks the tests themselves and nothing of the CUDA paths",
    )
