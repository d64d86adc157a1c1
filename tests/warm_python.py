"""``python -m MODULE ARGS`` (or ``python -c CODE``) for the suite's launches, forked from an interpreter that has
imported torch and paratrain already, instead of a fresh one importing them again (about 2 CPU-s, and as long, per
launch).

The suite starts a CLI run or a launch a few hundred times; each fresh interpreter spent most of its life in
imports every one of them repeats. ``WarmPopen`` is ``subprocess.Popen`` for ``[python, -m, MODULE, ...]``
whose child is a fork of one long-lived server per pytest process (``tests/warm_python_server.py``), which
imported everything once. The child is set up as a fresh interpreter would be: its own stdin/stdout/stderr
and passed files (no others), working directory, environment, default signal handlers, ``sys.argv`` and
``sys.path[0]``, torch's thread count from ``OMP_NUM_THREADS``; then it runs MODULE as ``__main__``. Its pid is
a real process's: tests signal it and read its children as before. The server reaps it and sends back its
wait status and CPU time, which the suite's budget adds to the test's (``tests/suite_budget.py``).

What a fresh interpreter is for stays fresh: the harness starts one for a run in a user's own environment
(``start_cli(unset=...)``, ``launch_workers(env=...)``), which checks what a user's interpreter does at
start-up, and so do the docs' first recipe and their torchrun commands.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

# CPU-seconds of children reaped by the server, for this process's rusage-based accounting.
cpu_seconds_of_children = 0.0
_server: _Server | None = None
_server_lock = threading.Lock()


class WarmPopen(subprocess.Popen):
    """``subprocess.Popen([sys.executable, "-m", MODULE, *args], ...)`` with the child forked from the warm
    server. Takes Popen's arguments; the command must be of that form (a warm server runs Python modules)."""

    def _execute_child(  # subprocess.Popen's own signature (POSIX)
        self,
        args,
        executable,
        preexec_fn,
        close_fds,
        pass_fds,
        cwd,
        env,
        startupinfo,
        creationflags,
        shell,
        p2cread,
        p2cwrite,
        c2pread,
        c2pwrite,
        errread,
        errwrite,
        *rest,
    ) -> None:
        given = (p2cread, c2pwrite, errwrite)
        standard = [fd if fd != -1 else inherited for fd, inherited in zip(given, (0, 1, 2), strict=True)]
        request = {
            **_what_to_run(args),
            "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            "env": dict(os.environ if env is None else env),
            "pass_fds": list(pass_fds),
        }
        self._connection = _server_connection()
        _send(self._connection, request, [*standard, *pass_fds])
        # The child's ends of pipes Popen made for it (as Popen closes them); a caller's own file stays open.
        made = {p2cread: p2cwrite, c2pwrite: c2pread, errwrite: errread}
        for fd in {fd for fd, other_end in made.items() if fd != -1 and other_end != -1}:
            os.close(fd)
        self.pid = json.loads(_read_line(self._connection))["pid"]
        self._child_created = True

    def _internal_poll(self, _deadstate=None, **_):
        if self.returncode is None and self._connection.fileno() == -1:
            # Dropped while its child ran (subprocess's _cleanup polls it later): its connection, closed with
            # it, can tell nothing more. As Popen does for a child it cannot wait for.
            if _deadstate is not None:
                self.returncode = _deadstate
        elif self.returncode is None and _ready(self._connection, 0):
            self._record_exit()
        return self.returncode

    def _wait(self, timeout):
        if self.returncode is not None:
            return self.returncode
        if not _ready(self._connection, timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        self._record_exit()
        return self.returncode

    def _record_exit(self) -> None:
        global cpu_seconds_of_children
        if self.returncode is not None:
            return
        line = _read_line(self._connection)
        reply = json.loads(line) if line else {"status": 0x7F00, "cpu_s": 0.0}  # the server died: unknown
        cpu_seconds_of_children += reply["cpu_s"]
        self._handle_exitstatus(reply["status"])
        self._connection.close()


def run(args: list[str], *, timeout: float | None = None, **popen_kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a WarmPopen: output captured when ``capture_output``; killed past ``timeout``."""
    if popen_kwargs.pop("capture_output", False):
        popen_kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with WarmPopen(args, **popen_kwargs) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


def _what_to_run(args: list[str]) -> dict[str, Any]:
    """``python -m MODULE ARGV`` as {"module", "argv"}, ``python -c CODE ARGV`` as {"code", "argv"}."""
    if len(args) < 3 or args[0] != sys.executable or args[1] not in ("-m", "-c"):
        raise ValueError(f"a warm server runs `{sys.executable} -m MODULE ...` or `-c CODE ...`, not {args}")
    return {"module" if args[1] == "-m" else "code": args[2], "argv": list(args[3:])}


def _ready(connection: socket.socket, timeout: float | None) -> bool:
    return bool(select.select([connection], [], [], timeout)[0])


def _read_line(connection: socket.socket) -> str:
    """One reply, read a byte at a time: nothing of the next is taken off the socket, whose readiness says
    whether the child's exit came."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = connection.recv(1)
        if not byte:
            break
        line += byte
    return line.decode()


def _send(connection: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], fds)


class _Server:
    """The warm interpreter of this process, started on first use and stopped when this process exits."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="paratrain-warm-")
        self.address = os.path.join(self.directory, "server")
        # Imports run single-threaded (numpy's BLAS would start a thread per core) so that forks are safe;
        # and the server is no launch of the test that happens to start it.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("PARATRAIN_TEST_LAUNCH_LOG", None)
        ready_r, ready_w = os.pipe()
        # Its own output to a file of its own: started inside a test, it would otherwise write into, and hold
        # open, that test's captured output. Its children get their files from each request.
        self.log = os.path.join(self.directory, "server.log")
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.warm_python_server", self.address, str(ready_w)],
                pass_fds=(ready_w,),
                env=env,
                cwd=Path(__file__).resolve().parent.parent,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        os.close(ready_w)
        with os.fdopen(ready_r) as ready:
            if ready.read() != "ready":
                code = self.process.wait()
                raise RuntimeError(f"the warm server did not start ({code}):\n{Path(self.log).read_text()[-3000:]}")
        atexit.register(self.stop)

    def stop(self) -> None:
        self.process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)


def _server_connection() -> socket.socket:
    global _server
    with _server_lock:
        if _server is None or _server.process.poll() is not None:
            _server = _Server()
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(_server.address)
        return connection
