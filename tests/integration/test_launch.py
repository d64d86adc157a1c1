"""What a single-node multi-process run exposes, and how it stops when asked to."""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from pathlib import Path

from tests.harness import start_cli, tiny_config, write_config


def test_single_node_run_listens_on_loopback_only(tmp_path):
    config = write_config(tmp_path / "run.yaml", tiny_config(tmp_path / "run", train={"max_steps": 400},
                                                             parallel={"strategy": "ddp"}, log={"every_steps": 1}))
    launcher = start_cli(["train", str(config), "--nproc-per-node", "2"])
    try:
        _wait_for_first_step(tmp_path / "run" / "metrics.jsonl", launcher)
        listeners = {pid: _listening_addresses(pid) for pid in [launcher.pid, *_children(launcher.pid)]}
    finally:
        launcher.terminate()  # torchrun stops its workers on SIGTERM
        _, stderr = launcher.communicate(timeout=60)
    workers = [pid for pid in listeners if pid != launcher.pid]
    assert len(workers) == 2, f"expected 2 workers under the launcher, found {workers}"
    # The launcher hosts the rendezvous store and the store the workers' process group shares.
    assert len(listeners[launcher.pid]) >= 2, listeners
    exposed = {pid: [a for a in addresses if not _is_loopback(a)] for pid, addresses in listeners.items()}
    assert not any(exposed.values()), f"listening beyond loopback: {exposed}"


def _wait_for_first_step(metrics: Path, process, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert process.poll() is None, f"run ended early: {process.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "no step logged in time"
        time.sleep(0.1)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4, after the parenthesised name
                found.append(int(entry))
    return found


def _listening_addresses(pid: int) -> list[str]:
    """Local addresses of the TCP sockets in LISTEN state that process pid holds open."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
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
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return f"{socket.inet_ntop(family, raw)}:{int(port, 16)}"


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.rsplit(":", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback
