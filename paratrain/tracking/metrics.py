"""The loop's metrics: when a step is logged and what its record holds (``should_log``, ``LogWindow``,
``build_record``), then, on rank 0, the trackers named in log.trackers (trackers.py) and a progress bar or
plain log lines. The loop hands numbers (a step's loss and verdict, its waits, its evaluation time) and asks
``should_log``; the window keeps the per-step values on the device between log steps, so the steps in
between never synchronise with the host."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from paratrain.parallel.collectives import all_reduce_sum
from paratrain.tracking.trackers import Outcome, RunInfo, build_trackers

__all__ = [
    "LogWindow",
    "MetricsLogger",
    "NoMetrics",
    "Outcome",
    "RunInfo",
    "build_record",
    "open_metrics",
    "should_log",
    "strict_json_record",
]

if TYPE_CHECKING:
    from paratrain.config.schema import LogConfig, RunConfig

logger = logging.getLogger("paratrain")


def should_log(step: int, *, every_steps: int, max_steps: int) -> bool:
    """Whether ``step`` (just taken) is logged: every ``log.every_steps``-th, the last, and the first,
    which shows that the job is running and when training began."""
    return step % every_steps == 0 or step in (1, max_steps)


@dataclass
class LogWindow:
    """The steps since the last logged one: their summed loss (on device) and where their time went.

    Args:
        loss_sum: Sum of the applied steps' losses, a 0-d tensor on the run's device.
        started: ``time.perf_counter()`` when the window opened, moved on by time spent evaluating.
    """

    loss_sum: torch.Tensor
    started: float = field(default_factory=time.perf_counter)
    steps: int = 0
    data_wait: float = 0.0  # seconds this rank waited for the loader's next batch

    @classmethod
    def open(cls, device: torch.device) -> LogWindow:
        return cls(torch.zeros((), device=device))

    def next_batch(self, batches: Iterator[list[Any]]) -> list[Any]:
        """The next step's micro-batches, the wait for them counted."""
        waited = time.perf_counter()
        micro_batches = next(batches)
        self.data_wait += time.perf_counter() - waited
        return micro_batches

    def add_step(self, loss: torch.Tensor, *, finite: torch.Tensor) -> None:
        """Counts a step; its loss is left out of the sum when its gradients were not finite (not applied)."""
        self.steps += 1
        self.loss_sum += torch.where(finite.to(loss.device), loss, 0.0)

    def leave_out(self, seconds: float) -> None:
        """Excludes time spent on something else (evaluation): step time measures training alone."""
        self.started += seconds

    def mean_loss(self, applied: int, *, group: dist.ProcessGroup | None = None, dp: int = 1) -> float:
        """The mean loss over the window's ``applied`` (not skipped) steps, NaN when none was applied.

        Args:
            applied: Steps of the window whose update was applied.
            group: The loss mesh's group (data-parallel ranks and the last pipeline stage), or None in
                one process. Only ranks holding the last pipeline stage have a loss (all ranks, without a
                pipeline); the others add zero. The reduction also waits for the window's work, for the
                step time.
            dp: Data-parallel degree: the sum over ``group`` is divided by it.
        """
        loss = self.loss_sum / max(applied, 1)
        if group is not None:
            loss = all_reduce_sum(loss, group=group) / dp
        return loss.item() if applied else float("nan")

    def seconds_per_step(self) -> float:
        return (time.perf_counter() - self.started) / self.steps


def build_record(
    window: LogWindow,
    *,
    step: int,
    loss: float,
    lr: float,
    grad_norm: float,
    samples_per_step: int,
    tokens_per_sample: int | None,
    epoch: int,
    world_size: int,
    skipped_steps: int,
) -> dict[str, Any]:
    """What a logged step writes: metrics.jsonl's line and every tracker's record (the loop adds
    ``eval_loss`` and ``eval_time_s`` on evaluation steps, callbacks their own fields).

    Args:
        window: The steps since the last logged one: their time and their wait for data.
        step: The step just taken.
        loss: Mean loss over the window's applied steps, across data-parallel ranks (NaN if none applied).
        lr: Learning rate the step used.
        grad_norm: Global gradient norm of the step, before clipping.
        samples_per_step: ``train.global_batch_size``.
        tokens_per_sample: Tokens in a sample, or None when samples are not token ids.
        epoch: Epoch of the data position.
        world_size: Processes in the run.
        skipped_steps: Steps skipped over the whole run for non-finite gradients.
    """
    step_time_s = window.seconds_per_step()
    samples_per_s = samples_per_step / step_time_s
    record = {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "step_time_s": step_time_s,
        "samples_per_s": samples_per_s,
        # Rank 0's share of the step spent waiting for data: the loader keeps up when it is near 0.
        "data_wait_fraction": window.data_wait / (step_time_s * window.steps),
        "epoch": epoch,
        "world_size": world_size,
        "time": time.time(),
    }
    if skipped_steps:
        record["skipped_steps"] = skipped_steps  # over the run, not the window
    if tokens_per_sample:
        record["tokens_per_s"] = samples_per_s * tokens_per_sample
    return record


class MetricsLogger:
    """Receives each logged step's metrics (already reduced across ranks) on rank 0.

    Args:
        run: Name, output_dir and resolved config, recorded by every tracker.
        trackers: Names from log.trackers (jsonl, tensorboard, wandb, mlflow).
        progress_bar: "auto" shows a bar only when stderr is a terminal.
        start_step: Steps already done (non-zero on resume).
        max_steps: Steps the run ends at.
    """

    def __init__(
        self,
        run: RunInfo,
        *,
        trackers: list[str],
        progress_bar: Literal["auto", "on", "off"],
        start_step: int,
        max_steps: int,
    ):
        self._trackers = build_trackers(trackers, run)
        show_bar = progress_bar == "on" or (progress_bar == "auto" and sys.stderr.isatty())
        self._bar = tqdm(total=max_steps, initial=start_step, unit="step", dynamic_ncols=True) if show_bar else None
        # While the bar is drawn, log lines (checkpoints saved, warnings) go above it, not through it.
        self._undo = contextlib.ExitStack()
        if self._bar:
            self._undo.enter_context(logging_redirect_tqdm())
        self._max_steps = max_steps

    def step_done(self) -> None:
        if self._bar:
            self._bar.update(1)

    def log(self, metrics: dict[str, Any]) -> None:
        strict = strict_json_record(metrics)  # every tracker gets null, not NaN, and the names in "nonfinite"
        for tracker in self._trackers:
            tracker.log(strict)
        if self._bar:
            self._bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}", refresh=False)
        else:
            logger.info(_format_line(metrics, self._max_steps))

    def close(self, outcome: Outcome = "success") -> None:
        """Closes every tracker with how the run ended (a failed or preempted run is marked so)."""
        self._undo.close()
        for tracker in self._trackers:
            tracker.close(outcome)
        if self._bar:
            self._bar.close()


def strict_json_record(metrics: dict[str, Any]) -> dict[str, Any]:
    """The record with NaN and infinite numbers as null, named in a ``nonfinite`` list: JSON has no
    NaN, and a line holding one is not valid JSON to strict readers (jq, JavaScript, pandas' engine)."""
    bad = [name for name, value in metrics.items() if isinstance(value, float) and not math.isfinite(value)]
    if not bad:
        return metrics
    return {**{name: None if name in bad else value for name, value in metrics.items()}, "nonfinite": bad}


class NoMetrics:
    """What ranks other than 0 get: they reduce metrics with everyone but write nothing."""

    def step_done(self) -> None: ...

    def close(self, outcome: Outcome = "success") -> None: ...


def _format_line(metrics: dict[str, Any], max_steps: int) -> str:
    parts = [
        f"step {metrics['step']}/{max_steps}",
        f"loss {metrics['loss']:.4f}",
        f"lr {metrics['lr']:.3e}",
        f"grad_norm {metrics['grad_norm']:.3f}",
        f"{metrics['samples_per_s']:.1f} samples/s",
    ]
    if "tokens_per_s" in metrics:
        parts.append(f"{metrics['tokens_per_s']:.0f} tokens/s")
    return " | ".join(parts)


def open_metrics(
    log: LogConfig, run: RunConfig, hparams: dict[str, Any], *, is_main: bool, start_step: int, max_steps: int
) -> MetricsLogger | NoMetrics:
    """Rank 0's metrics for the ``log`` section's trackers and progress bar; nothing on other ranks.

    Args:
        log: The ``log`` section.
        run: The ``run`` section: its name and output_dir, recorded by every tracker.
        hparams: The resolved config, recorded by every tracker.
        is_main: Whether this is rank 0, the only rank that writes metrics.
        start_step: Steps already done (non-zero on resume).
        max_steps: Steps the run ends at.
    """
    if not is_main:
        return NoMetrics()
    return MetricsLogger(
        RunInfo(name=run.name, output_dir=run.output_dir, hparams=hparams),
        trackers=log.tracker_names(),
        progress_bar=log.progress_bar,
        start_step=start_step,
        max_steps=max_steps,
    )
