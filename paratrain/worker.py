"""The worker process paratrain's launcher starts under torchrun: ``paratrain.train`` imported with automatic
garbage collection paused (``paratrain.launch.gc_pause``).

Those imports (torch, DTensor, DCP, FSDP, sympy) make about 300k objects, none of them garbage. Collection is
back on before ``main`` runs, and ``main`` freezes those objects out of its reach before training.
``python -m paratrain.train`` works the same, with slower imports.
"""

from __future__ import annotations

import sys

from paratrain.launch.gc_pause import collections_paused

if __name__ == "__main__":
    with collections_paused():
        from paratrain.train import main  # here, not above: imported with collection paused
    sys.exit(main())
