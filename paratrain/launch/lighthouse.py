"""torchft's lighthouse, the quorum server every replica group joins: its address, the start-up check that it
answers, and ``paratrain lighthouse``. torchft is an optional extra (``pip install 'paratrain[ft]'``), imported
only where replica groups are on."""

from __future__ import annotations

import os
import signal
import socket
import time
import urllib.parse
from pathlib import Path
from typing import Any

from paratrain.config.schema import FaultToleranceConfig
from paratrain.errors import ConfigError
from paratrain.files import write_whole

INSTALL_HINT = "pip install 'paratrain[ft]'"
# torchft's Rust side (the lighthouse, each group's manager server) logs every quorum and commit at INFO
# through RUST_LOG's filter: about 10 KB per step per group, which drowns the training log and fills any
# pipe nobody reads (a lighthouse or group blocked on a full stderr pipe stalls every group's quorum).
# Warnings and errors stay; set RUST_LOG=info to see the rest.
RUST_LOG_DEFAULT = "warn"


def lighthouse_host_port(address: str, *, key: str = "parallel.fault_tolerance.lighthouse") -> tuple[str, int]:
    """``http://HOST:PORT`` (or ``HOST:PORT``) as (HOST, PORT).

    Raises:
        ConfigError: naming ``key`` when there is no host or port.
    """
    parts = urllib.parse.urlsplit(address if "://" in address else f"http://{address}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise ConfigError(f"{key}={address!r} is not an address: write it as http://HOST:PORT")
    return parts.hostname, port


def check_lighthouse_reachable(options: FaultToleranceConfig) -> None:
    """Waits up to ``options.connect_timeout_s`` for the lighthouse to accept a connection.

    Raises:
        ConfigError: naming the address, the wait and how to start one, before anything trains.
    """
    host, port = lighthouse_host_port(options.lighthouse)
    deadline = time.monotonic() + options.connect_timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"parallel.fault_tolerance.lighthouse={options.lighthouse} did not answer within "
                    f"parallel.fault_tolerance.connect_timeout_s={options.connect_timeout_s:g} s ({error}); start "
                    f"it first with `paratrain lighthouse --bind {host}:{port}` (one for all replica groups), or "
                    f"point the key at the running one"
                ) from error
        time.sleep(0.2)


def run_lighthouse(
    *, bind: str, min_replicas: int, join_timeout_ms: int, heartbeat_timeout_ms: int, address_file: Path | None = None
) -> int:
    """Serves torchft's lighthouse until SIGINT or SIGTERM (``paratrain lighthouse``); writes the address it serves
    at to ``address_file`` once it listens, whole or not at all (a reader never sees half of it)."""
    lighthouse_server = import_torchft("the lighthouse")._torchft.LighthouseServer
    lighthouse_host_port(bind, key="--bind")
    server = lighthouse_server(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    print(f"paratrain: lighthouse serving at {server.address()} (min_replicas={min_replicas})", flush=True)
    if address_file is not None:
        write_whole(address_file, server.address() + "\n")
    stopped = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda number, frame: stopped.append(number))
    while not stopped:
        time.sleep(0.2)
    server.shutdown()
    return 0


# What a replica group's workers import beyond paratrain's worker: the launcher's fork server imports it once
# (launch/forked_workers.py), so that a worker restarted after a failure does not (about 0.1 CPU-s, while every
# live group waits for it).
REPLICA_GROUP_PRELOAD = ("torchft",)


def replica_group_environment() -> dict[str, str]:
    """What torchft reads as it is imported, for the process that imports it for the workers."""
    return {"RUST_LOG": os.environ.get("RUST_LOG", RUST_LOG_DEFAULT)}


def import_torchft(what: str) -> Any:
    os.environ.update(replica_group_environment())  # read when torchft's Rust logger starts
    try:
        import torchft  # lazy: an optional extra, needed only when replica groups are on
    except ImportError as error:
        raise ConfigError(
            f"{what} need torchft, which is not installed: {INSTALL_HINT} (or set "
            f"parallel.fault_tolerance.replica_groups=1)"
        ) from error
    return torchft
