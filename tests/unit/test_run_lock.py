"""One run per output directory: who may take run.output_dir's lock, and what a refusal says."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from paratrain.errors import ConfigError
from paratrain.launch.preemption import LAUNCHER_PID_ENV
from paratrain.launch.run_lock import LOCK_NAME, acquire_run_lock, worker_lock_pid


def exited_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    return gone.pid


def plant_lock(directory, *, host: str, pid: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / LOCK_NAME).write_text(json.dumps({"host": host, "pid": pid, "since": "2025-01-01T08:00:00"}))


def test_a_second_run_is_refused_naming_the_holder_and_the_fix(tmp_path):
    first = acquire_run_lock(tmp_path / "run", pid=os.getpid())
    with pytest.raises(ConfigError) as refused:
        acquire_run_lock(tmp_path / "run", pid=os.getppid())
    message = str(refused.value)
    assert f"is in use by another run (pid {os.getpid()} on host {socket.gethostname()}, since " in message
    assert "use another run.output_dir, or wait for that run to end" in message and f"kill {os.getpid()}" in message
    first.release()
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    acquire_run_lock(tmp_path / "run", pid=os.getppid()).release()  # free again


def test_a_lock_left_by_a_process_that_exited_is_taken_over_saying_so(tmp_path):
    dead = exited_pid()
    plant_lock(tmp_path, host=socket.gethostname(), pid=dead)
    lock = acquire_run_lock(tmp_path, pid=os.getpid())
    assert lock.notice.startswith(f"took over run lock {tmp_path / LOCK_NAME}: it was left by pid {dead} on host")
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_a_lock_from_another_host_is_refused_naming_the_host_and_how_to_remove_it(tmp_path):
    plant_lock(tmp_path, host="node-7", pid=exited_pid())  # dead here says nothing about node-7
    with pytest.raises(ConfigError, match=f"a run on host node-7 .* delete {tmp_path / LOCK_NAME}"):
        acquire_run_lock(tmp_path, pid=os.getpid())


def test_the_holder_enters_its_own_lock_again_as_restarted_workers_do(tmp_path):
    first = acquire_run_lock(tmp_path, pid=os.getppid())  # the torchrun agent's pid, as rank 0 takes it
    again = acquire_run_lock(tmp_path, pid=os.getppid())  # a restarted rank 0 under the same agent
    assert again.holder == first.holder and "already held by this run" in again.notice


def test_release_never_removes_another_runs_lock(tmp_path):
    lock = acquire_run_lock(tmp_path, pid=os.getpid())
    plant_lock(tmp_path, host="node-7", pid=123)  # e.g. deleted by hand and taken by another run since
    lock.release()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == "node-7"


@pytest.mark.parametrize(
    "environ,expected",
    [
        ({}, "self"),  # python -m paratrain.train, alone
        ({"RANK": "0", "TORCHELASTIC_RUN_ID": "x"}, "parent"),  # plain torchrun: for the agent
        ({"RANK": "1", "TORCHELASTIC_RUN_ID": "x"}, None),
        ({"RANK": "0", "TORCHELASTIC_RUN_ID": "x", LAUNCHER_PID_ENV: "42"}, None),  # paratrain's launcher holds it
    ],
)
def test_which_worker_holds_the_lock_and_for_whom(environ, expected):
    pids = {"self": os.getpid(), "parent": os.getppid(), None: None}
    assert worker_lock_pid(environ) == pids[expected]


def test_an_output_directory_the_lock_made_goes_with_it_when_the_run_wrote_nothing(tmp_path):
    # A run refused after taking its lock (the memory check, say) leaves no empty run directory behind.
    lock = acquire_run_lock(tmp_path / "new-run", pid=os.getpid())
    lock.release()
    assert not (tmp_path / "new-run").exists()
    kept = acquire_run_lock(tmp_path / "used-run", pid=os.getpid())
    (tmp_path / "used-run" / "metrics.jsonl").write_text("{}\n")
    kept.release()
    assert (tmp_path / "used-run").is_dir() and not (tmp_path / "used-run" / "paratrain.lock").exists()
