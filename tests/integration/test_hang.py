"""A step that hangs ends the job with every rank's stack on disk and a summary, instead of hanging."""

from __future__ import annotations

import time

from paratrain.errors import EXIT_HANG
from tests.harness import tiny_config, train, write_config


def test_a_rank_stuck_in_a_step_makes_every_rank_report_its_stack_and_the_job_exit_124(tmp_path):
    config = write_config(
        tmp_path / "run.yaml",
        tiny_config(
            tmp_path / "run", train={"max_steps": 20}, parallel={"strategy": "ddp"}, debug={"step_timeout_s": 3}
        ),
    )

    started = time.monotonic()
    hung = train(config, nproc=2, env={"PARATRAIN_FAULT": "stall_in_step:4:1"}, check=False)
    assert hung.returncode == EXIT_HANG, hung.stderr[-3000:]
    assert time.monotonic() - started < 60, "ended by the watchdog, not by the fault's hour-long sleep"

    hang = tmp_path / "run" / "hang"
    stuck, waiting = (hang / "rank1.txt").read_text(), (hang / "rank0.txt").read_text()
    assert stuck.startswith("rank 1: step 4 running for") and "not in a collective: maybe_stall" in stuck
    assert "faults.py" in stuck and "in train_step" in stuck  # faulthandler's stack of the training thread
    assert waiting.startswith("rank 0: step 4 running for") and "waiting in" in waiting
    summary = (hang / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary] == ["rank 0", "rank 1"]
    assert "hang: where each rank is" in hung.stderr and summary[1] in hung.stderr
