"""paratrain on a real Slurm: a one-machine cluster (Debian's slurm-wlm and munge; slurmctld and slurmd
on 127.0.0.1 with 2 CPUs, a slurm.conf generated in a temp dir) runs a 2-process job submitted by
``paratrain slurm --submit``, and requeues it after USR1 stops it with exit 75. A job of two replica groups
(``--replica-groups 2``: a lighthouse step and a step per group, sharing the one node) is stopped by USR1,
requeued, and trains on to the end as a plain two-process run does.

.ci/run installs the packages where it is root with apt; elsewhere these tests skip, saying why.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness import (
    checkpoint_weights,
    free_loopback_port,
    losses_by_step,
    max_relative_difference,
    max_weight_difference,
    run_cli,
    start_cli,
    tiny_config,
    train,
    write_config,
)

DAEMONS = ("munged", "slurmctld", "slurmd")


def _missing() -> str | None:
    absent = [name for name in (*DAEMONS, "sbatch", "scontrol", "scancel") if shutil.which(name) is None]
    if absent:
        return (
            f"Slurm not installed ({', '.join(absent)} missing): apt-get install slurm-wlm munge (.ci/run does as root)"
        )
    if os.geteuid() != 0:
        return "the one-machine Slurm cluster runs its daemons as root"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


def _slurm_conf(directory: Path, host: str) -> str:
    return f"""ClusterName=paratrain
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_loopback_port()}
SlurmdPort={free_loopback_port()}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={directory}/munge.sock
CredType=cred/munge
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd.pid
SlurmctldLogFile={directory}/slurmctld.log
SlurmdLogFile={directory}/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> dict[str, str]:
    """A running one-node cluster; yields the environment its clients need. Stops every daemon it started."""
    directory = tmp_path_factory.mktemp("slurm")
    (directory / "state").mkdir()
    (directory / "spool").mkdir()
    key = directory / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    host = socket.gethostname().split(".")[0]
    (directory / "slurm.conf").write_text(_slurm_conf(directory, host))
    env = {**os.environ, "SLURM_CONF": str(directory / "slurm.conf")}
    commands = [
        ["munged", f"--key-file={key}", f"--socket={directory}/munge.sock", f"--pid-file={directory}/munged.pid",
         f"--log-file={directory}/munged.log", f"--seed-file={directory}/munge.seed", "--force"],
        ["slurmctld", "-c", "-i"],
        ["slurmd", "-N", host],
    ]  # fmt: skip
    try:
        for command in commands:
            subprocess.run(command, env=env, check=True, timeout=30)
        _wait_until(lambda: "idle" in _client(env, "sinfo", "-h", "-o", "%t"), what="the node to be idle")
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True)
        for daemon in reversed(DAEMONS):
            pid_file = directory / f"{daemon}.pid"
            if pid_file.is_file():
                _stop(int(pid_file.read_text().split()[0]))


def _stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.1)


def _client(env: dict[str, str], *command: str) -> str:
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=30).stdout


def _wait_until(condition, *, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def _job(env: dict[str, str], job_id: str) -> dict[str, str]:
    text = _client(env, "scontrol", "show", "job", job_id)
    return dict(re.findall(r"(\w+)=(\S*)", text))


def _job_restarts_and_state(env: dict[str, str], job_id: str) -> tuple[str | None, str | None]:
    job = _job(env, job_id)
    return job.get("Restarts"), job.get("JobState")


def _submit(env: dict[str, str], config: Path, *overrides: str) -> str:
    args = ["slurm", str(config), *overrides, "--nodes", "1", "--gpus-per-node", "2", "--device", "cpu", "--submit"]
    result = run_cli(args, env=env)
    assert result.returncode == 0, result.stderr
    return re.search(r"submitted job (\d+)", result.stdout).group(1)


def test_job_submitted_by_paratrain_slurm_trains_like_a_plain_two_process_run(slurm, tmp_path):
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "slurm-run", train={"max_steps": 6}))
    job_id = _submit(slurm, config)
    plain = start_cli(["train", str(config), "--nproc-per-node", "2", f"run.output_dir={tmp_path / 'plain'}"])
    _wait_until(lambda: _job(slurm, job_id).get("JobState") in ("COMPLETED", "FAILED"), what="the job to end")
    assert plain.wait(timeout=240) == 0, plain.communicate()[1][-3000:]
    assert _job(slurm, job_id)["JobState"] == "COMPLETED", (tmp_path / "slurm-run" / f"slurm-{job_id}.out").read_text()
    slurm_losses = losses_by_step(tmp_path / "slurm-run")
    assert sorted(slurm_losses) == [1, 2, 3, 4, 5, 6]
    assert slurm_losses == losses_by_step(tmp_path / "plain")


def test_usr1_to_the_job_stops_it_at_an_agreed_step_with_exit_75_and_requeues_it(slurm, tmp_path):
    output_dir = tmp_path / "preempted"
    config = write_config(tmp_path / "c.yaml", tiny_config(output_dir, train={"max_steps": 100_000}))
    job_id = _submit(slurm, config)
    metrics = output_dir / "metrics.jsonl"
    _wait_until(lambda: metrics.is_file() and metrics.read_text().strip(), what="the job's first step")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=slurm, check=True)
    _wait_until(lambda: _job(slurm, job_id).get("Restarts") == "1", what="the job to be requeued")
    subprocess.run(["scancel", job_id], env=slurm, check=True)  # requeued; its second run is not this test's
    log = (output_dir / f"slurm-{job_id}.out").read_text()
    stopped = re.search(r"stopped at step (\d+) on SIGUSR1 after saving (\S+);", log)
    assert stopped, log
    assert Path(stopped.group(2)).name == f"step-{stopped.group(1)}" and Path(stopped.group(2)).is_dir()
    assert "exit code 75" in log and f"requeueing job {job_id}" in log
    assert int(stopped.group(1)) < 100_000


@pytest.mark.timeout(900)
def test_replica_groups_job_runs_a_lighthouse_and_a_step_per_group_requeues_and_trains_as_a_plain_run(slurm, tmp_path):
    steps, output_dir = 30, tmp_path / "groups"
    sections = {"train": {"max_steps": steps}, "checkpoint": {"every_steps": 5}}
    config = write_config(tmp_path / "c.yaml", tiny_config(output_dir, **sections))
    args = ["slurm", str(config), "--nodes", "1", "--gpus-per-node", "2", "--device", "cpu", "--replica-groups", "2"]
    # Half a second a step (the job inherits the variable): time for USR1 to land mid-run.
    result = run_cli([*args, "--submit"], env={**slurm, "PARATRAIN_FAULT": f"slow_step:1-{steps}"})
    assert result.returncode == 0, result.stderr
    job_id = re.search(r"submitted job (\d+)", result.stdout).group(1)
    metrics = output_dir / "replica-group-0" / "metrics.jsonl"
    _wait_until(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 3, what="the groups' steps")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=slurm, check=True)
    requeued = ("1", "PENDING")
    _wait_until(lambda: _job_restarts_and_state(slurm, job_id) == requeued, what="the job to be requeued")
    # Slurm holds a requeued job for two minutes; release it now, as an administrator may.
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=slurm, check=True)
    done = ("COMPLETED", "FAILED", "CANCELLED")
    _wait_until(lambda: _job(slurm, job_id).get("JobState") in done, what="the requeued job to end", timeout=600)
    log = (output_dir / f"slurm-{job_id}.out").read_text()
    assert _job(slurm, job_id)["JobState"] == "COMPLETED", log[-4000:]
    assert "exited with codes 75 75" in log and f"requeueing job {job_id}" in log and "exited with codes 0 0" in log
    plain = tmp_path / "plain"
    train(config, f"run.output_dir={plain}", nproc=2)
    for group in ("replica-group-0", "replica-group-1"):
        losses = losses_by_step(output_dir / group)  # a step trained again after the requeue: its newest loss
        assert sorted(losses) == list(range(1, steps + 1))
        assert max_relative_difference(losses, losses_by_step(plain)) <= 1e-5
        weights = checkpoint_weights(output_dir / group / f"checkpoints/step-{steps}")
        assert max_weight_difference(weights, checkpoint_weights(plain / f"checkpoints/step-{steps}")) <= 1e-5
