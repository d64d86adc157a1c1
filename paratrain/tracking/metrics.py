"""Rank-0 metric sinks: metrics.jsonl, TensorBoard, and a progress bar or plain log lines."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Any, Literal

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

logger = logging.getLogger("paratrain")


class MetricsLogger:
    """Receives each logged step's metrics (already reduced across ranks) on rank 0.

    Args:
        output_dir: Where metrics.jsonl and tensorboard/ go.
        tensorboard: Also write TensorBoard event files.
        progress_bar: "auto" shows a bar only when stderr is a terminal.
        start_step: Steps already done (non-zero on resume).
        max_steps: Steps the run ends at.
    """

    def __init__(
        self,
        output_dir: Path,
        *,
        tensorboard: bool,
        progress_bar: Literal["auto", "on", "off"],
        start_step: int,
        max_steps: int,
    ):
        self._jsonl = open(output_dir / "metrics.jsonl", "a", buffering=1)
        self._tensorboard = _open_tensorboard(output_dir / "tensorboard") if tensorboard else None
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
        self._jsonl.write(json.dumps(metrics) + "\n")
        if self._tensorboard:
            for name, value in metrics.items():
                if isinstance(value, (int, float)) and name != "step":
                    self._tensorboard.add_scalar(f"train/{name}", value, metrics["step"])
        if self._bar:
            self._bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}", refresh=False)
        else:
            logger.info(_format_line(metrics, self._max_steps))

    def close(self) -> None:
        self._undo.close()
        self._jsonl.close()
        if self._tensorboard:
            self._tensorboard.close()
        if self._bar:
            self._bar.close()


class NoMetrics:
    """What ranks other than 0 get: they reduce metrics with everyone but write nothing."""

    def step_done(self) -> None: ...

    def close(self) -> None: ...


def _open_tensorboard(directory: Path):
    from torch.utils.tensorboard import SummaryWriter  # imported only when enabled: it loads TensorBoard

    return SummaryWriter(log_dir=str(directory))


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
