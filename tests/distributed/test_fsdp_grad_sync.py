"""parallel.fsdp.grad_sync changes how often FSDP communicates, not only a flag."""

from __future__ import annotations

import json
from pathlib import Path

from tests.harness import launch_workers


def count(tmp_path: Path, *policies: str) -> dict:
    out = tmp_path / "counts.json"
    result = launch_workers(2, "tests.distributed.count_reduce_scatters", str(out), str(tmp_path), *policies)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def test_deferring_gradient_sync_reduce_scatters_once_per_step_instead_of_once_per_micro_batch(tmp_path):
    counts = count(tmp_path, "last_micro_batch", "every_micro_batch")
    deferred, eager = counts["last_micro_batch"], counts["every_micro_batch"]
    assert deferred["accumulation"] == eager["accumulation"] == 4  # 16 samples / (2 per micro-batch x 2 ranks)
    assert deferred["units"] == 3  # two blocks and the root
    assert deferred["reduce_scatters"] == deferred["steps"] * deferred["units"]
    assert eager["reduce_scatters"] == eager["steps"] * eager["units"] * eager["accumulation"]
