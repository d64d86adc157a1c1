"""No garbage collection while a checkpoint is saved or loaded.

DCP's planning and metadata make tens of thousands of short-lived objects (a read or write item per tensor
piece, on every rank), enough to set off several collections, each walking every object the run holds. None
of them frees anything that matters: the objects are not cyclic garbage. A full collection cost 0.13 s of a
0.7 s fsdp x2 load in the checkpoint benchmark.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """Automatic collection off inside, back as it was after (a collection is not forced then)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
