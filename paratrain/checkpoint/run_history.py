"""The run directory's record of its attempts, and the failure rate learned from it.

Rank 0 appends to ``output_dir/attempts.jsonl`` one line when training starts (time, step, nodes) and one when
it ends (time, step, outcome: success, preempted or failed). An attempt that a failure ended leaves no end
line (the process was killed, the node lost) or one whose outcome is ``failed`` (an error stopped it): either
counts as a failure. A preemption is no failure: it saved first and lost nothing. The attempt in progress is
not counted: it has not ended yet.

The node's MTBF is then estimated as (prior + node-hours seen) / (1 + failures seen): the configured
``checkpoint.mtbf_hours`` counts as one failure-free MTBF already observed, so a run without history uses it
as it is, and each failure and each hour run pulls the estimate towards what this run has seen.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ATTEMPTS_NAME = "attempts.jsonl"
Outcome = Literal["success", "preempted", "failed"]


@dataclass(frozen=True)
class FailureHistory:
    """What the attempts before this one saw: failures, and node-hours run (the time from each attempt's start
    to its end, or to the next attempt's start when it left no end, times its nodes)."""

    failures: int = 0
    node_hours: float = 0.0

    def node_mtbf_hours(self, *, prior_hours: float) -> float:
        """The node's MTBF: the prior counted as one failure-free MTBF, pooled with what was seen."""
        return (prior_hours + self.node_hours) / (1 + self.failures)


def record_start(output_dir: Path, *, step: int, nodes: int, now: float | None = None) -> None:
    """Appends the start of an attempt (rank 0 only)."""
    _append(output_dir, {"event": "start", "time": time.time() if now is None else now, "step": step, "nodes": nodes})


def record_end(output_dir: Path, *, step: int, outcome: Outcome, now: float | None = None) -> None:
    """Appends the end of the attempt in progress (rank 0 only)."""
    _append(output_dir, {"event": "end", "time": time.time() if now is None else now, "step": step, "outcome": outcome})


def read_history(output_dir: Path) -> FailureHistory:
    """The failures and node-hours of the attempts recorded in ``output_dir``; none when it records none. A line
    that does not parse (a write cut short by the failure it records) is skipped."""
    path = output_dir / ATTEMPTS_NAME
    if not path.is_file():
        return FailureHistory()
    events = [event for line in path.read_text().splitlines() if (event := _parse(line)) is not None]
    starts = [index for index, event in enumerate(events) if event["event"] == "start"]
    failures, node_hours = 0, 0.0
    for first, following in zip(starts, starts[1:]):  # every attempt but the last, which may be running
        start, attempt = events[first], events[first + 1 : following]
        end = next((event for event in attempt if event["event"] == "end"), None)
        failures += end is None or end.get("outcome") == "failed"
        until = end["time"] if end is not None else events[following]["time"]
        node_hours += max(0.0, until - start["time"]) / 3600 * start.get("nodes", 1)
    return FailureHistory(failures, node_hours)


def _parse(line: str) -> dict | None:
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) and event.get("event") in ("start", "end") and "time" in event else None


def _append(output_dir: Path, event: dict) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir / ATTEMPTS_NAME, "a+b") as handle:
        # A line a killed process left unfinished is ended first: the new one must not join it and be lost.
        size = handle.seek(0, os.SEEK_END)
        handle.seek(max(0, size - 1))
        ended = size == 0 or handle.read(1) == b"\n"
        handle.write((b"" if ended else b"\n") + json.dumps(event).encode() + b"\n")  # appended at the end
