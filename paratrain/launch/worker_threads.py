"""torchrun's default of one OpenMP thread per worker, applied before the launcher imports torch.

torchrun sets ``OMP_NUM_THREADS=1`` for its workers when it starts several on a node and the variable is unset,
but only once it runs, after the launcher has imported torch and numpy: by then numpy's BLAS has started a
thread per core in the launcher, whose fork server must then be a fresh interpreter
(``paratrain.launch.forked_workers`` forks only a single-threaded launcher). Set first, the same value reaches
the workers and the launcher stays single-threaded. This module imports nothing heavy.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

THREADS_VARIABLE = "OMP_NUM_THREADS"
_NPROC_OPTION = "--nproc-per-node"


def apply_torchruns_thread_default(argv: Sequence[str]) -> None:
    """For ``paratrain train ... --nproc-per-node N`` with N > 1 and ``OMP_NUM_THREADS`` unset: sets it to 1,
    as torchrun would, and says so as torchrun does."""
    if THREADS_VARIABLE in os.environ or not argv or argv[0] != "train" or _nproc_per_node(argv) <= 1:
        return
    os.environ[THREADS_VARIABLE] = "1"
    print(
        f"paratrain: {THREADS_VARIABLE}=1 in each worker (torchrun's default for several processes on a node, so "
        f"that they do not overload it); set {THREADS_VARIABLE} to tune it",
        file=sys.stderr,
    )


def _nproc_per_node(argv: Sequence[str]) -> int:
    """The value of --nproc-per-node N or --nproc-per-node=N; 1 where absent or not a number (the parser
    reports that later, with the rest of the command line)."""
    for index, arg in enumerate(argv):
        value = None
        if arg == _NPROC_OPTION and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith(_NPROC_OPTION + "="):
            value = arg.split("=", 1)[1]
        if value is not None:
            return int(value) if value.isdigit() else 1
    return 1
