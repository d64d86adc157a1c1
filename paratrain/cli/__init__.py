"""``paratrain``: the command line. ``parser.py`` declares the commands and their options, ``train_handoff.py``
hands a training run to this process or to torchrun workers, and ``commands.py`` runs the other commands."""

from __future__ import annotations

import os
import sys

from paratrain.errors import RUN_ENDINGS, CheckpointWriteError, Preempted, exit_code_of
from paratrain.launch.gc_pause import collections_paused
from paratrain.launch.worker_threads import apply_torchruns_thread_default


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the process's own command line, before anything imports torch
        apply_torchruns_thread_default(sys.argv[1:])
    # Like `python -m`, so factories in the user's project directory import.
    sys.path.insert(0, os.getcwd())
    args = _parser().parse_args(argv)
    try:
        return args.handler(args)
    except RUN_ENDINGS as error:
        say_how_it_ended(error)
        return exit_code_of(error)


def say_how_it_ended(error: Exception) -> None:
    """The message alone, no traceback: it already names the key and the fix (a stop in a one-process run
    trained in this one says where it stopped; a failed save was reported by the checkpointer)."""
    if isinstance(error, CheckpointWriteError):
        return
    print(f"paratrain: {error}" if isinstance(error, Preempted) else f"paratrain: error: {error}", file=sys.stderr)


def _parser():
    # lazy: the commands import torch, which main() must not before it has read its command line; with
    # collections paused: ~300k objects, none of them garbage (paratrain.launch.gc_pause)
    with collections_paused():
        from paratrain.cli import parser

    return parser


def __getattr__(name: str):
    # lazy, as in _parser()
    if name in ("build_parser", "parse_args"):
        return getattr(_parser(), name)
    raise AttributeError(f"module 'paratrain.cli' has no attribute {name!r}")


__all__ = ["build_parser", "main", "parse_args"]
