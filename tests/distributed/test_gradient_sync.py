"""Gradient accumulation under DDP communicates once per optimizer step, not once per micro-batch."""

from __future__ import annotations

import json
from pathlib import Path

from tests.harness import launch_workers


def count_syncs(tmp_path: Path, *micro_batch_sizes: int) -> dict:
    out = tmp_path / "syncs.json"
    result = launch_workers(
        2, "tests.distributed.count_gradient_syncs", str(out), str(tmp_path), *map(str, micro_batch_sizes)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def test_accumulating_four_micro_batches_syncs_gradients_as_often_as_one_micro_batch(tmp_path):
    # Global batch 16 on 2 ranks: micro-batch 8 is one micro-batch per step, micro-batch 2 is four.
    counts = count_syncs(tmp_path, 8, 2)
    one, four = counts["8"], counts["2"]
    assert one["steps"] == four["steps"] == 3
    # A tiny bucket cap gives several buckets per sync (after DDP's first step, which uses one), so
    # the counts are not trivially equal: syncing on every micro-batch would show as ~4x as many.
    assert one["syncs"] > one["steps"]
    assert four["syncs"] == one["syncs"]
