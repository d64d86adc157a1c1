"""Measured pipeline timelines: when each forward and backward really ran, per rank and step.

The recorder wraps each stage's ``forward_one_chunk``, ``backward_one_chunk`` and
``backward_weight_one_chunk`` (what every torch schedule calls to compute) and notes their start and
end on the system-wide monotonic clock, which all processes of one machine share. Each step starts
after a barrier of the pipeline group, so all ranks begin together as the theory assumes; the
bubble is then the share of ranks x step time not spent computing (``measured_bubble``).
Communication waits count as idle, as they do for the hardware.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_KEEP_STEPS = 50


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


class TimelineRecorder:
    """Keeps the last steps' action times of one rank and writes them as JSON."""

    def __init__(
        self, path: Path, *, rank: int, group: dist.ProcessGroup | None, device: torch.device, describe: dict[str, Any]
    ):
        self.path, self.rank, self.group, self.device = path, rank, group, device
        self.describe = describe
        self.steps: deque[dict[str, Any]] = deque(maxlen=_KEEP_STEPS)
        self._current: list[list] | None = None

    def instrument(self, stage: Any) -> None:
        """Wraps the stage's compute methods (in place) so each call is timed."""
        stage.forward_one_chunk = self._timed(stage.forward_one_chunk, stage.stage_index, lambda kw: "F")
        stage.backward_one_chunk = self._timed(
            stage.backward_one_chunk, stage.stage_index, lambda kw: "B" if kw.get("full_backward", True) else "I"
        )
        stage.backward_weight_one_chunk = self._timed(
            stage.backward_weight_one_chunk, stage.stage_index, lambda kw: "W"
        )

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Times one schedule step, started together with the other pipeline ranks."""
        if self.group is not None:
            dist.barrier(group=self.group)
        self._current, start = [], _now()
        try:
            yield
        finally:
            self._synchronize()
            self.steps.append({"start": start, "end": _now(), "actions": self._current})
            self._current = None

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"rank": self.rank, **self.describe, "steps": list(self.steps)}
        self.path.write_text(json.dumps(record))

    def _timed(self, method, stage_index: int, kind_of):
        @functools.wraps(method)
        def timed(chunk_id, *args, **kwargs):
            start = _now()
            result = method(chunk_id, *args, **kwargs)
            self._synchronize()
            if self._current is not None:
                self._current.append([stage_index, kind_of(kwargs), chunk_id, start, _now()])
            return result

        return timed

    def _synchronize(self) -> None:
        # GPU kernels run asynchronously: wait for them so the end time is when the work finished.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def read_timelines(directory: Path) -> list[dict[str, Any]]:
    """Every rank's recorded timeline in a run's ``pipeline/`` directory, by rank."""
    files = sorted(directory.glob("timeline-rank*.json"))
    return sorted((json.loads(path.read_text()) for path in files), key=lambda record: record["rank"])


def measured_bubble(timelines: list[dict[str, Any]], *, skip_first: int = 1) -> float:
    """Idle share of all pipeline ranks' time over the recorded steps (the first ones warm up).

    Each rank file may hold several pipelines (data-parallel replicas); each replica's bubble is
    computed over its own pp ranks, then averaged.
    """
    by_replica: dict[int, list[dict[str, Any]]] = {}
    for record in timelines:
        by_replica.setdefault(record["replica"], []).append(record)
    return sum(_replica_bubble(ranks, skip_first) for ranks in by_replica.values()) / len(by_replica)


def _replica_bubble(ranks: list[dict[str, Any]], skip_first: int) -> float:
    steps = min(len(record["steps"]) for record in ranks)
    if steps <= skip_first:
        raise ValueError(f"only {steps} step(s) recorded; need more than {skip_first} to measure past warm-up")
    idle = []
    for index in range(skip_first, steps):
        per_rank = [record["steps"][index] for record in ranks]
        start = max(step["start"] for step in per_rank)
        end = max(step["end"] for step in per_rank)
        busy = sum(action[4] - action[3] for step in per_rank for action in step["actions"])
        idle.append(1 - busy / (len(ranks) * (end - start)))
    return sum(idle) / len(idle)
