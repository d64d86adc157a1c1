"""The worker process paratrain's launcher starts under torchrun: ``paratrain.train`` imported with automatic
garbage collection paused (``paratrain.launch.gc_pause``).

Those imports (torch, DTensor, DCP, FSDP, sympy) make about 300k objects, none of them garbage. Collection is
back on before ``main`` runs, and ``main`` freezes those objects out of its reach before training.
``python -m paratrain.train`` works the same, with slower imports.

Where the workers are forked (``paratrain.launch.forked_workers``), the fork server imports this module once,
and each worker runs it as ``__main__`` with its imports done.
"""

from __future__ import annotations

import sys

from paratrain.launch.gc_pause import collections_paused

with collections_paused():
    import torch._dynamo  # noqa: F401 - DDP's constructor imports it: once in a fork server, not in each worker

    from paratrain.train import main

if __name__ == "__main__":
    sys.exit(main())
