"""parallel.fsdp.grad_sync changes how often FSDP communicates, not only a flag."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.harness import REPO_ROOT

SCRIPT = Path(__file__).with_name("count_reduce_scatters.py")


def count(tmp_path: Path, *policies: str) -> dict:
    out = tmp_path / "counts.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               str(SCRIPT), str(out), str(tmp_path), *policies]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def test_deferring_gradient_sync_reduce_scatters_once_per_step_instead_of_once_per_micro_batch(tmp_path):
    counts = count(tmp_path, "last_micro_batch", "every_micro_batch")
    deferred, eager = counts["last_micro_batch"], counts["every_micro_batch"]
    assert deferred["accumulation"] == eager["accumulation"] == 4  # 16 samples / (2 per micro-batch x 2 ranks)
    assert deferred["units"] == 3  # two blocks and the root
    assert deferred["reduce_scatters"] == deferred["steps"] * deferred["units"]
    assert eager["reduce_scatters"] == eager["steps"] * eager["units"] * eager["accumulation"]
