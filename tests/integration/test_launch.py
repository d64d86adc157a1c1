"""What a single-node multi-process run exposes, and how it stops when asked to."""

from __future__ import annotations

import ipaddress
import json
import multiprocessing
import os
import re
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from paratrain.checkpoint import verify_checkpoint
from paratrain.errors import EXIT_REQUEUE
from paratrain.launch.forked_workers import forks_workers
from paratrain.launch.run_lock import LOCK_NAME
from tests.harness import (
    child_pids,
    launch_workers,
    run_cli_in_process,
    start_cli,
    tiny_config,
    wait_for_first_step,
    worker_pids,
    write_config,
)


def test_single_node_run_listens_on_loopback_only_refuses_a_second_run_and_stops_for_a_requeue_on_sigusr1(tmp_path):
    config = write_config(
        tmp_path / "run.yaml",
        tiny_config(tmp_path / "run", train={"max_steps": 400}, parallel={"strategy": "ddp"}, log={"every_steps": 1}),
    )
    # The user's default environment: no OMP_NUM_THREADS.
    launcher = start_cli(["train", str(config), "--nproc-per-node", "2"], unset=("OMP_NUM_THREADS",))
    try:
        wait_for_first_step(tmp_path / "run", launcher)
        listeners = {pid: _listening_addresses(pid) for pid in [launcher.pid, *worker_pids(launcher.pid)]}
        # The fork server: the launcher's child with children (its other one is multiprocessing's tracker).
        servers = [_command_line(child) for child in child_pids(launcher.pid) if child_pids(child)]
        launcher_command = _command_line(launcher.pid)
        second = _second_run_into(config, holder=launcher.pid, lock=tmp_path / "run" / LOCK_NAME)
    finally:
        launcher.send_signal(signal.SIGUSR1)
        _, stderr = launcher.communicate(timeout=120)
    assert second.returncode == 2 and second.seconds < 15, second
    assert not (tmp_path / "run" / LOCK_NAME).exists(), "released on the way out of a requeue (exit 75)"
    workers = [pid for pid in listeners if pid != launcher.pid]
    assert len(workers) == 2, f"expected 2 workers under the launcher, found {workers}"
    if forks_workers():
        # torchrun's OMP_NUM_THREADS=1 set before the launcher imported torch, so numpy's BLAS started no
        # threads in it: its fork server is a fork of it (the launcher's command line), not a fresh interpreter.
        assert "OMP_NUM_THREADS=1 in each worker" in stderr, stderr[-3000:]
        assert servers == [launcher_command], servers
    # The launcher hosts the rendezvous store and the store the workers' process group shares.
    assert len(listeners[launcher.pid]) >= 2, listeners
    exposed = {pid: [a for a in addresses if not _is_loopback(a)] for pid, addresses in listeners.items()}
    assert not any(exposed.values()), f"listening beyond loopback: {exposed}"

    # The launcher passed SIGUSR1 on; the workers agreed on a step, saved it and exited for a requeue.
    assert launcher.returncode == EXIT_REQUEUE, stderr[-3000:]
    stop_step = int(re.search(r"stopped at step (\d+) on SIGUSR1", stderr).group(1))
    verify_checkpoint(tmp_path / "run" / "checkpoints" / f"step-{stop_step}")


@dataclass(frozen=True)
class _Refused:
    returncode: int
    seconds: float


def _second_run_into(config: Path, *, holder: int, lock: Path) -> _Refused:
    """A second ``paratrain train`` into the live run's output_dir: refused before launching, naming the holder."""
    assert json.loads(lock.read_text())["pid"] == holder, "node 0's launcher holds the lock"
    started = time.monotonic()
    code, stderr = run_cli_in_process(["train", str(config), "--nproc-per-node", "2"])
    assert f"is in use by another run (pid {holder} on host {socket.gethostname()}, since " in stderr, stderr
    assert "use another run.output_dir, or wait for that run to end" in stderr, stderr
    return _Refused(code, time.monotonic() - started)


def _listening_addresses(pid: int) -> list[str]:
    """Local addresses of the TCP sockets in LISTEN state that process pid holds open."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    addresses = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: TCP_LISTEN
                addresses.append(_decode_address(local, family))
    return addresses


def _decode_address(hex_address: str, family: int) -> str:
    """/proc/net/tcp{,6} prints addresses as 32-bit words in host (little-endian) byte order."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return f"{socket.inet_ntop(family, raw)}:{int(port, 16)}"


def _command_line(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1]


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.rsplit(":", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def test_a_worker_starts_as_a_fresh_interpreter_would_and_its_exit_code_is_the_launchers(tmp_path):
    """Where torch has no GPU runtime the workers are forks of a server that is itself a fork of the launcher
    (launch/forked_workers.py): each still finds what ``python -u -m MODULE ARGS`` would give it, and nothing
    of the launcher's: not a file it holds open (as its run lock), not its signal handlers. The first launch
    is with the user's default environment (no OMP_NUM_THREADS: torchrun sets it to 1 after the launcher
    imported torch), the second with the harness's."""
    user_env = {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"}
    held = tmp_path / "held-open-by-the-launcher"
    for exit_code, env in ((0, user_env), (9, None)):
        out_dir = tmp_path / str(exit_code)
        out_dir.mkdir()
        with held.open("w") as file:
            result = launch_workers(
                2,
                "tests.integration.forked_worker_probe",
                str(out_dir),
                str(exit_code),
                env=env,
                pass_fds=(file.fileno(),),
            )
        assert result.returncode == exit_code, result.stderr[-3000:]
        for rank in range(2):
            found = json.loads((out_dir / f"rank-{rank}.json").read_text())
            assert str(held) not in found.pop("files_open")
            assert found == {
                "imported_before_start": forks_workers(),  # forked: its imports done; else a fresh interpreter
                "preloaded_before_start": forks_workers(),  # and what the launcher was asked to preload for it
                "argv": [str(out_dir), str(exit_code)],
                "start_method": multiprocessing.get_start_method(),  # this interpreter's default: fork on Linux
                "blocked_signals": [],  # the server's blocked stop signals are delivered to the worker
                "threads": 1,  # OMP_NUM_THREADS: torchrun's for several workers, or the harness's
                "line_buffered": True,  # as `python -u`
                "handlers_installed": [],  # none of the launcher's (SIGTERM, SIGUSR1, its stop notice)
            }, rank
            assert (out_dir / f"exited-{rank}").exists(), "the worker's exit functions ran"
    # A non-zero exit is named once, as for a subprocess worker, without the traceback of torchrun's own join.
    assert "paratrain: rank 1 failed (exit code 9)" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
