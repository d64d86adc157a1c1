"""What a single-node multi-process run exposes, and how it stops when asked to."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import socket
from pathlib import Path

from paratrain.checkpoint import verify_checkpoint
from paratrain.errors import EXIT_REQUEUE
from tests.harness import child_pids, start_cli, tiny_config, wait_for_first_step, write_config


def test_single_node_run_listens_on_loopback_only_and_stops_for_a_requeue_on_sigusr1_to_the_launcher(tmp_path):
    config = write_config(
        tmp_path / "run.yaml",
        tiny_config(tmp_path / "run", train={"max_steps": 400}, parallel={"strategy": "ddp"}, log={"every_steps": 1}),
    )
    launcher = start_cli(["train", str(config), "--nproc-per-node", "2"])
    try:
        wait_for_first_step(tmp_path / "run", launcher)
        listeners = {pid: _listening_addresses(pid) for pid in [launcher.pid, *child_pids(launcher.pid)]}
    finally:
        launcher.send_signal(signal.SIGUSR1)
        _, stderr = launcher.communicate(timeout=120)
    workers = [pid for pid in listeners if pid != launcher.pid]
    assert len(workers) == 2, f"expected 2 workers under the launcher, found {workers}"
    # The launcher hosts the rendezvous store and the store the workers' process group shares.
    assert len(listeners[launcher.pid]) >= 2, listeners
    exposed = {pid: [a for a in addresses if not _is_loopback(a)] for pid, addresses in listeners.items()}
    assert not any(exposed.values()), f"listening beyond loopback: {exposed}"

    # The launcher passed SIGUSR1 on; the workers agreed on a step, saved it and exited for a requeue.
    assert launcher.returncode == EXIT_REQUEUE, stderr[-3000:]
    stop_step = int(re.search(r"stopped at step (\d+) on SIGUSR1", stderr).group(1))
    verify_checkpoint(tmp_path / "run" / "checkpoints" / f"step-{stop_step}")


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


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.rsplit(":", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback
