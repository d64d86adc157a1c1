"""benchmarks/replica_groups_overhead.py compares the same processes in both layouts, and its step time leaves the
start-up out."""

from __future__ import annotations

import json
from pathlib import Path

from tests.tools.benchmark_scripts import load_benchmark

overhead = load_benchmark("replica_groups_overhead")


def test_both_layouts_run_the_same_processes_and_degrees():
    hsdp = overhead.train_jobs("hsdp", Path("c.yaml"), groups=3, procs=2)
    groups = overhead.train_jobs("replica groups", Path("c.yaml"), groups=3, procs=2)
    assert len(hsdp) == 1 and "6" in hsdp[0] and "parallel.dp_replicate=3" in hsdp[0]
    assert len(groups) == 3
    for index, job in enumerate(groups):
        assert job[job.index("--replica-group") + 1] == str(index) and "parallel.dp_shard=2" in job


def test_the_steady_step_time_is_the_mean_step_after_the_warm_up(tmp_path):
    # A slow start (2 s to step 1, 1 s to step 2), then 0.1 s a step: the start-up must not count.
    times = [2.0, 3.0, *(3.0 + 0.1 * k for k in range(1, 9))]
    lines = [json.dumps({"step": step, "time": time}) for step, time in enumerate(times, start=1)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert abs(overhead.steady_step_s(tmp_path, warmup=2) - 0.1) < 1e-9
