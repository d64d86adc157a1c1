"""What an earlier attempt of this launch found, for torchrun's restart of it to take as known.

A replica group restarted after a failure is what every live group waits for, so each check its restart repeats
costs every group that time: checking a sample against the model on meta took 19 ms on an idle core, 35-45 ms
beside the live groups' steps, of a restart's ~0.4 s. A check that passed in an earlier attempt of the same launch,
on the same sections of the config, is recorded in the run directory and not run again. A first attempt always runs
it, and so does a restart of a launch where no attempt passed it (one that stopped on a ConfigError): the record
names the launch (host, the paratrain launcher's pid, torchrun's run id) and a digest of what was checked. Workers
started by hand under torchrun, with no paratrain launcher, always check.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from paratrain.files import write_whole
from paratrain.launch.preemption import LAUNCHER_PID_ENV

RECORD_NAME = ".passed-checks"


def passed_in_an_earlier_attempt(output_dir: Path, *, check: str, digest: str) -> bool:
    """Whether this process is a restart and an earlier attempt of its launch recorded ``check`` passing on
    ``digest``."""
    key = _launch_key(check, digest)
    if key is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        return False
    try:
        return key in (output_dir / RECORD_NAME).read_text().splitlines()
    except OSError:
        return False


def record_passed(output_dir: Path, *, check: str, digest: str) -> None:
    """Records that ``check`` passed on ``digest`` in this launch (replacing an earlier launch's record)."""
    key = _launch_key(check, digest)
    if key is None:
        return
    try:
        write_whole(output_dir / RECORD_NAME, key + "\n")  # every rank writes it
    except OSError:
        pass  # no record only means that a restart checks again


def _launch_key(check: str, digest: str) -> str | None:
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is None:
        return None
    return " ".join([check, socket.gethostname(), launcher, os.environ.get("TORCHELASTIC_RUN_ID", ""), digest])
