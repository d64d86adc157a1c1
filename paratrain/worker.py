"""The worker process paratrain's launcher starts under torchrun: ``paratrain.train`` imported with automatic
garbage collection paused (``paratrain.launch.gc_pause``).

Those imports (torch, DTensor, DCP, FSDP, sympy) make about 300k objects, none of them garbage. Collection is
back on before ``main`` runs, and ``main`` freezes those objects out of its reach before training.
``python -m paratrain.train`` works the same, with slower imports.

`paratrain train` forks its workers instead (``FORKED``, ``paratrain.launch.forked_workers``): one server
process imports ``paratrain.train`` once and each worker, restarts included, is a fork of it, run as
``python -u -m paratrain.worker`` would run it.
"""

from __future__ import annotations

import os
import sys

from paratrain.launch.forked_workers import ForkedWorker
from paratrain.launch.gc_pause import collections_paused


def run_forked(*worker_args: str) -> None:
    """One worker forked from the server: the working directory first on ``sys.path`` (as ``-m`` puts it:
    the user's own modules), output written line by line (``-u``), ``main``'s exit code as the process's."""
    sys.path.insert(0, os.getcwd())
    sys.argv = [__name__, *worker_args]
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    from paratrain.train import main  # lazy: imported already, by the server this process was forked from

    code = main(list(worker_args))
    if code:
        sys.exit(code)


FORKED = ForkedWorker(entrypoint=run_forked, preload=("paratrain.train",))

if __name__ == "__main__":
    with collections_paused():
        from paratrain.train import main  # here, not above: imported with collection paused
    sys.exit(main())
