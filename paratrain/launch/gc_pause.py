"""Automatic garbage collection paused where a burst of objects that are not garbage would set it off.

A full collection walks every object the process holds. Where thousands of objects are made and none of them is
cyclic garbage, the collections they set off cost time and free nothing: a worker's imports (about 300k objects;
0.4 of 2.5 CPU-s), and a checkpoint's save or load (DCP's plans and metadata; 0.13 s a collection, a sixth of an
fsdp x2 load). This module imports nothing heavy, so that it can be used before torch is imported.
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
