"""MemoryMonitor: each rank's memory on log steps, reduced to the minimum and maximum over ranks.

Fields added to the metrics record (MiB, each as ``<name>_min`` and ``<name>_max`` over ranks):
``mem_rss_mb`` (resident set size now, from /proc/self/statm), ``mem_peak_rss_mb`` (the process's peak
resident set size, from getrusage), and on GPU ``mem_peak_allocated_mb`` / ``mem_peak_reserved_mb``
(torch.cuda.max_memory_allocated / max_memory_reserved since the previous log step: the peak counters
are reset after each reading). A process that drives several GPUs (parallel.strategy dp or
model_parallel) reports the largest over them, and each GPU's as ``..._cuda<index>`` besides.
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
        for gpu in _gpus(context.trainer.devices):
            torch.cuda.reset_peak_memory_stats(gpu)

    def on_step_end(self, context: CallbackContext) -> None:
        if context.record is None:
            return
        readings = rank_memory_mb(context.trainer.devices)
        # One collective for all fields; every rank reaches each log step, so every rank calls it.
        values = torch.tensor(list(readings.values()), dtype=torch.float64, device=context.trainer.ctx.device)
        minimum, maximum = all_reduce_min_max(values)
        for name, low, high in zip(readings, minimum.tolist(), maximum.tolist()):
            context.record[f"{name}_min"], context.record[f"{name}_max"] = low, high
        for gpu in _gpus(context.trainer.devices):
            torch.cuda.reset_peak_memory_stats(gpu)


def rank_memory_mb(devices: list[torch.device]) -> dict[str, float]:
    """This process's memory readings in MiB, over the devices it computes on."""
    rss = resident_set_size_bytes()
    # The kernel updates the high-water mark lazily, so it can trail the current size.
    readings = {"mem_rss_mb": rss / MIB, "mem_peak_rss_mb": max(rss, peak_resident_set_size_bytes()) / MIB}
    gpus = _gpus(devices)
    per_gpu = {gpu: gpu_peaks_mb(gpu) for gpu in gpus}
    for name in ("mem_peak_allocated_mb", "mem_peak_reserved_mb") if gpus else ():
        readings[name] = max(peaks[name] for peaks in per_gpu.values())
        if len(gpus) > 1:
            readings.update({f"{name}_cuda{gpu.index}": peaks[name] for gpu, peaks in per_gpu.items()})
    return readings


def gpu_peaks_mb(gpu: torch.device) -> dict[str, float]:
    """One GPU's peak allocated and reserved memory since its counters were last reset, in MiB."""
    return {
        "mem_peak_allocated_mb": torch.cuda.max_memory_allocated(gpu) / MIB,
        "mem_peak_reserved_mb": torch.cuda.max_memory_reserved(gpu) / MIB,
    }


def _gpus(devices: list[torch.device]) -> list[torch.device]:
    return [device for device in devices if device.type == "cuda"]


def resident_set_size_bytes() -> int:
    """Resident set size now (Linux: the second field of /proc/self/statm, in pages)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE_SIZE


def peak_resident_set_size_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
