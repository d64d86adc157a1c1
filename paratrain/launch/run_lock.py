"""One run per output directory: ``run.output_dir/paratrain.lock``, held for the run's whole life.

Two runs writing the same ``step-N`` checkpoints and metrics would each finish and leave a mix of both.
The lock is a small JSON file (host, pid, since) created with O_CREAT | O_EXCL, which is atomic on
local filesystems and on NFSv3 and later, where the output directory of a multi-node run lives;
fcntl/flock locks are not dependable across NFS. Whoever holds it:

- ``paratrain train``'s launcher on node 0 (its pid), across torchrun's restarts of the workers;
- a one-process ``paratrain train`` (its pid);
- under a plain ``torchrun -m paratrain.train``, the worker of global rank 0, for the torchrun agent
  (its parent pid), so that a worker torchrun restarts finds the lock its own and goes on.

A lock whose process is gone (same host, pid not running) is taken over, saying so. A lock from
another host cannot be checked from here: it is refused, naming how to remove it once stale.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from paratrain.errors import ConfigError

LOCK_NAME = "paratrain.lock"


@dataclass(frozen=True)
class LockHolder:
    """Who holds a run's lock."""

    host: str
    pid: int
    since: str  # local time, ISO 8601, to the second

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, since {self.since}"


@dataclass(frozen=True)
class RunLock:
    """A held lock: ``path`` holds ``holder``. ``notice`` says what taking it involved (a stale lock taken
    over, or the holder's own lock entered again), or is None."""

    path: Path
    holder: LockHolder
    notice: str | None = None
    made_directory: bool = False  # the output directory did not exist before the lock

    def release(self) -> None:
        """Removes the lock file if it still names this holder: never another run's lock. An output directory
        the lock made is removed too if the run left it empty (refused before writing anything)."""
        if _read(self.path) == self.holder:
            self.path.unlink(missing_ok=True)
            if self.made_directory and not any(self.path.parent.iterdir()):
                self.path.parent.rmdir()


def acquire_run_lock(output_dir: Path, *, pid: int) -> RunLock:
    """Takes ``output_dir``'s lock for process ``pid`` on this host (creating the directory).

    Raises:
        ConfigError: another live run holds it, or a run on another host does, naming it and the fix.
    """
    made_directory = not output_dir.exists()
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / LOCK_NAME
    mine = LockHolder(socket.gethostname(), pid, datetime.now().isoformat(timespec="seconds"))
    notice = None
    for _ in range(2):  # a second try after removing a stale lock; losing that race to a third run refuses
        if _create(path, mine):
            return RunLock(path, mine, notice, made_directory)
        held = _read(path)
        if held is None and not path.exists():  # released between our try and our read
            continue
        if held is None:
            raise ConfigError(
                f"run.output_dir {output_dir} is locked by {path}, which is being written or is not a paratrain lock: "
                f"use another run.output_dir, or delete {path} if no run uses this directory"
            )
        if held.host == mine.host and held.pid == pid:  # the same holder: torchrun restarted its workers
            return RunLock(path, held, f"run lock {path} is already held by this run ({held.describe()})")
        _refuse_unless_stale(held, output_dir=output_dir, path=path)
        notice = f"took over run lock {path}: it was left by {held.describe()}, which is no longer running"
        path.unlink(missing_ok=True)
    raise ConfigError(f"run.output_dir {output_dir}: another run took {path} just now; use another run.output_dir")


@contextmanager
def holding_run_lock(output_dir: Path, *, pid: int, say: Callable[[str], None]) -> Iterator[RunLock]:
    """acquire_run_lock for the ``with`` block, released on every way out of it; ``say`` gets the notice."""
    lock = acquire_run_lock(output_dir, pid=pid)
    if lock.notice:
        say(lock.notice)
    try:
        yield lock
    finally:
        lock.release()


def worker_lock_pid(environ: dict[str, str] | os._Environ) -> int | None:
    """The pid a worker started without paratrain's launcher holds the lock for, or None when this worker
    holds none: another rank, or paratrain's launcher (which holds it itself) started it.

    Under a plain torchrun that is the torchrun agent, this worker's parent, which outlives the workers it
    restarts; started alone (``python -m paratrain.train``), this process."""
    # Lazy: preemption loads torch.distributed, which the CLI's lock does not need.
    from paratrain.launch.preemption import LAUNCHER_PID_ENV

    if int(environ.get("RANK", 0)) != 0 or environ.get(LAUNCHER_PID_ENV):
        return None
    return os.getppid() if "TORCHELASTIC_RUN_ID" in environ else os.getpid()


def _refuse_unless_stale(held: LockHolder, *, output_dir: Path, path: Path) -> None:
    if held.host != socket.gethostname():
        raise ConfigError(
            f"run.output_dir {output_dir} is in use by a run on host {held.host} ({held.describe()}), which "
            f"cannot be checked from here: use another run.output_dir, or, if that run is over (a crashed "
            f"node leaves its lock behind), delete {path}"
        )
    if _is_running(held.pid):
        raise ConfigError(
            f"run.output_dir {output_dir} is in use by another run ({held.describe()}; lock {path}): use another "
            f"run.output_dir, or wait for that run to end (or stop it: kill {held.pid})"
        )


def _create(path: Path, holder: LockHolder) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as handle:
        json.dump(asdict(holder), handle)
    return True


def _read(path: Path) -> LockHolder | None:
    """The holder a lock file names, or None when it is missing, empty (still being written) or not a lock."""
    try:
        fields = json.loads(path.read_text())
        return LockHolder(str(fields["host"]), int(fields["pid"]), str(fields["since"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True
