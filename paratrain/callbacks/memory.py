"""MemoryMonitor: each rank's memory on log steps, reduced to the minimum and maximum over ranks.

Fields added to the metrics record (MiB, each as ``<name>_min`` and ``<name>_max`` over ranks):
``mem_rss_mb`` (resident set size now, from /proc/self/statm), ``mem_peak_rss_mb`` (the process's peak
resident set size, from getrusage), and on GPU ``mem_peak_allocated_mb`` / ``mem_peak_reserved_mb``
(torch.cuda.max_memory_allocated / max_memory_reserved since the previous log step: the peak counters
are reset after each reading).
"""

from __future__ import annotations

import os
import resource

import torch

from paratrain.callbacks.base import Callback, CallbackContext
from paratrain.parallel.collectives import all_reduce_min_max

MIB = 1024 * 1024
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


class MemoryMonitor(Callback):
    """Adds memory fields (min/max over ranks) to every logged step. Config:
    ``callbacks: [{factory: paratrain.callbacks.memory:MemoryMonitor}]``."""

    def on_train_start(self, context: CallbackContext) -> None:
        if context.trainer.ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(context.trainer.ctx.device)

    def on_step_end(self, context: CallbackContext) -> None:
        if context.record is None:
            return
        device = context.trainer.ctx.device
        readings = rank_memory_mb(device)
        # One collective for all fields; every rank reaches each log step, so every rank calls it.
        minimum, maximum = all_reduce_min_max(torch.tensor(list(readings.values()), dtype=torch.float64, device=device))
        for name, low, high in zip(readings, minimum.tolist(), maximum.tolist()):
            context.record[f"{name}_min"], context.record[f"{name}_max"] = low, high
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)


def rank_memory_mb(device: torch.device) -> dict[str, float]:
    """This process's memory readings in MiB."""
    rss = resident_set_size_bytes()
    # The kernel updates the high-water mark lazily, so it can trail the current size.
    readings = {"mem_rss_mb": rss / MIB, "mem_peak_rss_mb": max(rss, peak_resident_set_size_bytes()) / MIB}
    if device.type == "cuda":
        readings["mem_peak_allocated_mb"] = torch.cuda.max_memory_allocated(device) / MIB
        readings["mem_peak_reserved_mb"] = torch.cuda.max_memory_reserved(device) / MIB
    return readings


def resident_set_size_bytes() -> int:
    """Resident set size now (Linux: the second field of /proc/self/statm, in pages)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE_SIZE


def peak_resident_set_size_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
