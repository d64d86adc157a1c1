"""The warm interpreter's server (``python -m tests.warm_python_server ADDRESS READY_FD``, started by
tests/warm_python.py): imports torch and paratrain once, then forks a child per request on its Unix socket,
sets the child up as a fresh ``python -m MODULE`` (or ``-c CODE``) would start, and sends back its pid, then
its wait status and CPU time once it is reaped."""

from __future__ import annotations

import atexit
import builtins
import contextlib
import fcntl
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import traceback
from typing import Any

import torch

from paratrain.launch.forked_workers import drop_inherited_state

# What the children would otherwise import: the CLI and its training path, the launcher, and what forked
# workers (paratrain.launch.forked_workers) preload; and what many of the suite's runs import in each of
# their processes (workers are forks of a child's fork server): compiling's backends and inductor's pattern
# matcher (0.7 CPU-s a process), transformers and its Llama (about 2 CPU-s). A child that needs none of
# them copies nothing for them.
PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor.experimental",
    "torch._dynamo.backends.common",
    "torch._inductor.pattern_matcher",
    "torch._inductor.debug",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "paratrain.cli",
    "paratrain.train",
    "paratrain.worker",
)
MAX_FDS = 16  # stdin, stdout, stderr and the files a request passes
HIGH_FDS = 1000  # passed files keep numbers below this


def serve(address: str, ready_fd: int) -> None:
    """The server's loop: one connection per child; a child's exit status goes back on its connection."""
    for module in PRELOAD:
        importlib.import_module(module)
    gc.freeze()  # the imports' objects: children then copy no page for the collector's sake
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    child_exited = _pipe_woken_by_child_exits()
    os.write(ready_fd, b"ready")
    os.close(ready_fd)
    children: dict[int, socket.socket] = {}
    while True:
        with contextlib.suppress(InterruptedError):
            readable = select.select([listener, child_exited], [], [])[0]
        if listener in readable:
            connection, _ = listener.accept()
            pid = _fork_child(connection)
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = connection
        if child_exited in readable:
            os.read(child_exited, 4096)
        _reap(children)


def _pipe_woken_by_child_exits() -> int:
    """A pipe's read end that SIGCHLD writes to (signal.set_wakeup_fd): the loop's select wakes on it. The
    server stays one thread, which forking needs."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    return wake_r


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            reply = {"status": status, "cpu_s": usage.ru_utime + usage.ru_stime}
            with contextlib.suppress(OSError):
                connection.sendall(json.dumps(reply).encode() + b"\n")
            connection.close()


def _fork_child(connection: socket.socket) -> int:
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, MAX_FDS)
    request = json.loads(message)
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    code = 1
    try:
        _become_fresh(request, fds)
        code = _run_as_main(request)
    finally:
        os._exit(code)


def _become_fresh(request: dict[str, Any], fds: list[int]) -> None:
    """What a fresh ``python -m`` would start with: its files, directory, environment and handlers."""
    signal.set_wakeup_fd(-1)
    targets = [0, 1, 2, *request["pass_fds"]]
    # Above every target's number first, so that no dup2 below lands on a file still to be placed.
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, HIGH_FDS) for fd in fds]
    for source, target in zip(high, targets, strict=True):
        os.dup2(source, target)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # `python -m` puts the working directory first, and PYTHONPATH's entries before the installed packages.
    extra = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry and entry not in sys.path]
    sys.path[:1] = [request["cwd"], *extra]
    drop_inherited_state(keep_fds=targets)  # files, handlers, OMP_NUM_THREADS where set: as a forked worker's
    if not os.environ.get("OMP_NUM_THREADS", "").isdigit():  # torch's own default, not the server's one thread
        torch.set_num_threads(os.cpu_count() or 1)
    log = os.environ.get("PARATRAIN_TEST_LAUNCH_LOG")
    if log:  # counted as the interpreter it stands for (tests/launch_counter/sitecustomize.py)
        with contextlib.suppress(OSError), open(log, "a") as file:
            what = f"-m {request['module']}" if "module" in request else "-c"
            file.write(f"{os.getpid()} {what} {' '.join(request['argv'][:1])} (warm)\n")


def _run_as_main(request: dict[str, Any]) -> int:
    """``python -m MODULE ARGV`` or ``python -c CODE ARGV``, with the exit code the interpreter would give."""
    try:
        if "module" in request:
            sys.argv = [request["module"], *request["argv"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = ["-c", *request["argv"]], ""  # `python -c` puts "" (the directory) first
            exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
        code = 0
    except SystemExit as stopped:
        code = _exit_code(stopped.code)
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, then exit code 1
        traceback.print_exc()
        code = 1
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()  # noqa: SLF001 - what the interpreter runs at exit (multiprocessing's clean-up)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
