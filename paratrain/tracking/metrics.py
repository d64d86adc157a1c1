"""Rank 0's metrics: fanned out to the trackers named in log.trackers (trackers.py), and a progress bar
or plain log lines."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from typing import Any, Literal

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from paratrain.tracking.trackers import Outcome, RunInfo, build_trackers

logger = logging.getLogger("paratrain")


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
