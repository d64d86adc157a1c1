"""The ``profile.*`` window: torch.profiler over a few steps, a Chrome trace per rank, and on GPU an
optional snapshot of the CUDA caching allocator. It runs as the first callback, so a profiled step
includes the other callbacks' work of that step.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from paratrain.callbacks.base import Callback, CallbackContext
from paratrain.config.schema import ProfileConfig

logger = logging.getLogger("paratrain")

MEMORY_HISTORY_ENTRIES = 100_000  # allocator events kept for the snapshot (the oldest are dropped)


def maybe_profiler(options: ProfileConfig, *, directory: Path, rank: int, device: torch.device) -> list[Callback]:
    """[StepProfiler] when profile.enabled, else []."""
    return [StepProfiler(options, directory=directory, rank=rank, device=device)] if options.enabled else []


class StepProfiler(Callback):
    """Profiles steps wait+1 .. wait+warmup+active of this run (counted from its first step, also after a
    resume) and writes ``trace-rank<R>.json`` and, on GPU with profile.memory_snapshot,
    ``memory-rank<R>.pickle`` into ``directory``."""

    def __init__(self, options: ProfileConfig, *, directory: Path, rank: int, device: torch.device):
        self.options, self.directory, self.rank, self.device = options, directory, rank, device
        self.window_end = options.wait + options.warmup + options.active
        self.steps, self.profiler, self.recording_memory = 0, None, False

    @property
    def trace_path(self) -> Path:
        return self.directory / f"trace-rank{self.rank}.json"

    @property
    def snapshot_path(self) -> Path:
        return self.directory / f"memory-rank{self.rank}.pickle"

    def on_train_start(self, context: CallbackContext) -> None:
        # lazy: torch.profiler loads only when profiling is on
        from torch.profiler import ProfilerActivity, profile, schedule  # imported only when profiling

        remaining = context.trainer.config.train.max_steps - context.step
        if remaining < self.window_end and self.rank == 0:
            logger.warning(
                "profile window of %d steps is longer than the %d steps left to train: the trace "
                "stops at the last step",
                self.window_end,
                remaining,
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.profiler = profile(
            activities=activities,
            record_shapes=self.options.record_shapes,
            schedule=schedule(wait=self.options.wait, warmup=self.options.warmup, active=self.options.active, repeat=1),
            on_trace_ready=self._write_trace,
        )
        self.profiler.start()
        self._maybe_start_memory_history()

    def on_step_end(self, context: CallbackContext) -> None:
        if self.profiler is None:
            return
        self.profiler.step()
        self.steps += 1
        if self.steps == self.window_end:
            self._stop()

    def on_train_end(self, context: CallbackContext) -> None:
        self._stop()

    def _write_trace(self, profiler) -> None:
        profiler.export_chrome_trace(str(self.trace_path))
        logger.info("rank %d wrote profiler trace %s", self.rank, self.trace_path)

    def _maybe_start_memory_history(self) -> None:
        if not self.options.memory_snapshot:
            return
        if self.device.type != "cuda":
            if self.rank == 0:
                logger.info(
                    "profile.memory_snapshot skipped: CUDA memory snapshots need a GPU, this run is on %s",
                    self.device.type,
                )
            return
        torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self.recording_memory = True

    def _stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
        if self.recording_memory:
            torch.cuda.memory._dump_snapshot(str(self.snapshot_path))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording_memory = False
            logger.info("rank %d wrote CUDA memory snapshot %s", self.rank, self.snapshot_path)
