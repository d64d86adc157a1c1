"""A checkpoint the storage refuses (here a full disk: a small tmpfs under ``checkpoints/``) stops every
rank with exit code 74 and one message naming the step, the errno, the path and the checkpoint a resume
uses; the incomplete directory is removed, and a resume with more space continues from that checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from paratrain.checkpoint import verify_checkpoint
from paratrain.errors import EXIT_SAVE_FAILED
from paratrain.launch.run_lock import LOCK_NAME
from tests.harness import tiny_config, train, write_config

# A checkpoint of the tiny GPT (weights, AdamW moments, RNG) takes about 1.4 MB: the first fits, the second not.
DISK_KB = 2000
CHECKPOINT_KB = (DISK_KB // 2, DISK_KB)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path/run/checkpoints`` on a tmpfs of DISK_KB; the rest of the run's files on the usual disk."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    mount_point = tmp_path / "run" / "checkpoints"
    mount_point.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_KB}k", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "--lazy", str(mount_point)], check=True)


def config_for(tmp_path: Path, **checkpoint) -> Path:
    config = tiny_config(
        tmp_path / "run", train={"max_steps": 6}, checkpoint={"every_steps": 2, "keep_last": 1, **checkpoint}
    )
    return write_config(tmp_path / "run.yaml", config)


def assert_stopped_at_step_4_keeping_step_2(result: subprocess.CompletedProcess, checkpoints: Path) -> None:
    assert result.returncode == EXIT_SAVE_FAILED, result.stderr[-3000:]
    message = f"checkpoint step-4 was not saved: {os.strerror(28)} (ENOSPC) writing {checkpoints / 'step-4'}"
    assert result.stderr.count("step-4 was not saved") == 1, result.stderr[-3000:]  # one rank, one message
    assert message in result.stderr, result.stderr[-3000:]
    assert f"checkpoint.resume=auto continues from {checkpoints / 'step-2'}, the newest complete" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not (checkpoints / "step-4").exists(), "the incomplete checkpoint is removed"
    verify_checkpoint(checkpoints / "step-2")
    size_kb = sum(f.stat().st_size for f in (checkpoints / "step-2").iterdir()) // 1024
    assert CHECKPOINT_KB[0] < size_kb < CHECKPOINT_KB[1], f"step-2 takes {size_kb} KB: resize DISK_KB"


def test_full_disk_during_a_save_stops_with_74_naming_the_checkpoint_a_resume_uses(tmp_path, small_disk):
    config = config_for(tmp_path)
    full = train(config, check=False)
    assert_stopped_at_step_4_keeping_step_2(full, small_disk)

    # More space, and a lock left by a run whose process is gone (a launcher killed with SIGKILL).
    subprocess.run(["mount", "-o", "remount,size=8000k", str(small_disk)], check=True)
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    lock = tmp_path / "run" / LOCK_NAME
    lock.write_text(f'{{"host": "{os.uname().nodename}", "pid": {gone.pid}, "since": "2025-01-01T00:00:00"}}')
    resumed = train(config)
    assert f"took over run lock {lock}: it was left by pid {gone.pid}" in resumed.stderr
    assert f"resumed from {small_disk / 'step-2'} at step 2" in resumed.stderr
    verify_checkpoint(small_disk / "step-6")
    assert not lock.exists(), "released when the run ended"


def test_full_disk_during_an_async_save_stops_every_rank_with_74(tmp_path, small_disk):
    full = train(config_for(tmp_path, async_save=True), "parallel.strategy=ddp", nproc=2, check=False)
    # step-4 was written in the background; its failure surfaced when the step-6 save waited for it.
    assert_stopped_at_step_4_keeping_step_2(full, small_disk)
