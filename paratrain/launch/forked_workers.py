"""Workers forked from a process that has already imported torch and paratrain, instead of each importing them.

Each of torchrun's workers would otherwise start a fresh interpreter and import torch, DTensor, DCP and
paratrain: about 2 CPU-s a process, paid again by every restart torchrun makes after a failure. torchrun
starts a worker as a function too, through ``multiprocessing``; with the ``forkserver`` start method the
server imports those modules once (``PRELOADED``) and each worker is a fork of it, its imports done. The
server is itself a fork of the launcher, taken before torchrun's agent starts any thread: the launcher has
imported torch already, so the server adds only what the workers need beyond it (about 1 CPU-s less a launch
than a fresh interpreter importing everything). It then drops what it copied of the launcher and a fresh
interpreter would not have: open files (the run lock), signal handlers, ``OMP_NUM_THREADS`` read before
torchrun set it. Where the launcher already runs threads (or there is no ``/proc`` to tell), the server is
a fresh interpreter, as multiprocessing starts it. A worker then starts as its own interpreter would:
``python -u -m MODULE ARGS``, the stop signals delivered, multiprocessing's default start method and the exit
functions run at its end.

Only where torch has no GPU runtime: the CUDA runtime must not have been initialised in a process that forks,
and an availability check made while importing would do that; a GPU build starts each worker as a
subprocess, as torchrun does.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import runpy
import signal
import sys
import traceback
from collections.abc import Iterator, Sequence

import torch

from paratrain.launch.preemption import STOP_SIGNALS

START_METHOD = "forkserver"
# The module every paratrain worker runs (the launcher's default); it imports what training needs.
PRELOADED = ["paratrain.worker"]


def forks_workers() -> bool:
    """Whether this torch build has no GPU runtime (CUDA, ROCm or XPU) whose initialisation a fork could copy."""
    return not torch.backends.cuda.is_built() and not torch.xpu._is_compiled()


def run_workers(
    args: argparse.Namespace, worker_module: str, worker_args: list[str], *, preload: Sequence[str] = ()
) -> None:
    """torchrun's ``run(args)``, whose script is ``-m WORKER_MODULE WORKER_ARGS``, with its workers forked from a
    server that imported ``PRELOADED`` and ``preload``."""
    from torch.distributed.launcher.api import elastic_launch  # lazy: torchrun's modules, as in launcher.py
    from torch.distributed.run import config_from_args

    if args.master_port is None:  # as torchrun's run(): read by the static rendezvous only
        args.master_port = 29500
    config, _, _ = config_from_args(args)
    config.start_method = START_METHOD
    _start_server([*PRELOADED, *preload])
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_without_join_traceback)
    try:
        elastic_launch(config=config, entrypoint=run_module_as_main)(worker_module, *worker_args)
    finally:
        _stop_server()


def _start_server(preload: list[str]) -> None:
    """multiprocessing's fork server, having imported ``preload``: a fork of this process where it runs one
    thread, otherwise a fresh interpreter (multiprocessing's way)."""
    multiprocessing.set_forkserver_preload(preload)
    with stop_signals_blocked():
        multiprocessing.resource_tracker.ensure_running()  # a fresh interpreter of its own, as multiprocessing has it
        with _server_forked_from_this_process() if _single_threaded() else contextlib.nullcontext():
            multiprocessing.forkserver.ensure_running()


def _single_threaded() -> bool:
    """Whether this process runs one thread (OpenMP's and the C++ runtime's counted): a fork copies none."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


@contextlib.contextmanager
def _server_forked_from_this_process() -> Iterator[None]:
    """multiprocessing starts its fork server with ``util.spawnv_passfds(python, [python, ..., "-c", PROGRAM],
    fds)``; meanwhile the same PROGRAM runs in a fork of this process instead, which keeps the same fds."""
    spawn = multiprocessing.util.spawnv_passfds

    def fork_instead(path: str, args: Sequence[str], passfds: Sequence[int]) -> int:
        if "-c" not in args:  # not the command this was written for: started as multiprocessing starts it
            return spawn(path, args, passfds)
        return _fork_running(args[list(args).index("-c") + 1], keep_fds=passfds)

    multiprocessing.util.spawnv_passfds = fork_instead
    try:
        yield
    finally:
        multiprocessing.util.spawnv_passfds = spawn


def _fork_running(program: str, *, keep_fds: Sequence[int]) -> int:
    """Runs ``python -c PROGRAM`` in a fork of this process; returns the fork's pid."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # else the server would write the launcher's pending output a second time
    pid = os.fork()
    if pid != 0:
        return pid
    code = 1
    try:
        drop_inherited_state(keep_fds=keep_fds)
        exec(program, {"__name__": "__main__"})  # noqa: S102 - multiprocessing's own fork server program
        code = 0
    except SystemExit as stopped:  # the server's end, once the launcher has gone or stopped it
        code = stopped.code if isinstance(stopped.code, int) else 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)  # never back into the launcher's code


def drop_inherited_state(*, keep_fds: Sequence[int]) -> None:
    """In a fork, what a fresh interpreter would not have: the parent's files (the launcher's run lock: the
    workers must not hold it past the launcher), its signal handlers (a worker's SIGTERM is the worker's, not
    the launcher's), torch's thread count read before ``OMP_NUM_THREADS`` was set, and multiprocessing's
    fork-server lock, copied held. Also what the suite's warm interpreter gives each child (tests/)."""
    low = 3
    for fd in sorted({fd for fd in keep_fds if fd >= 3}):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))
    for signum in signal.valid_signals():
        handler = signal.getsignal(signum)
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(signum, signal.SIG_DFL)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    multiprocessing.forkserver._forkserver.__init__()  # noqa: SLF001 - its lock was held when this process forked


def _stop_server() -> None:
    """Ends the fork server and waits for it. It would end by itself once the launcher has, but then as an
    orphan: its own and its workers' CPU time would count for no process tree, and it would outlive the
    launcher by a moment. (``_stop`` is multiprocessing's one way to reach the server it started.)"""
    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """SIGTERM and SIGUSR1 held back while the fork server (and multiprocessing's resource tracker) start, so
    that they start with those signals blocked: a scheduler that signals every process of the job asks the
    workers to stop, and must not end the server under them. The launcher gets any that arrived meanwhile."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def run_module_as_main(module: str, *args: str) -> None:
    """``python -u -m MODULE ARGS`` inside a forked worker. Its exit code is the process's, as for a
    subprocess; exit code 0 returns instead, since torchrun waits for a return value from each worker."""
    _start_as_a_fresh_interpreter(module, args)
    # The server imported it for its imports; runpy runs it afresh as __main__, and would warn (in every
    # worker's output) that it found it imported already.
    sys.modules.pop(module, None)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stopped:
        if stopped.code not in (None, 0):
            raise
    finally:
        atexit._run_exitfuncs()  # a multiprocessing child ends with os._exit, which skips them


def _start_as_a_fresh_interpreter(module: str, args: tuple[str, ...]) -> None:
    sys.argv = [module, *args]
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked in the server: see stop_signals_blocked
    for stream in (sys.stdout, sys.stderr):  # as `python -u`: each line out at once
        stream.reconfigure(line_buffering=True)
    # The server's start method was inherited; the worker's data loaders fork, as in a fresh interpreter.
    multiprocessing.set_start_method(None, force=True)


def _without_join_traceback(record: logging.LogRecord) -> bool:
    """torchrun's record of a forked worker's non-zero exit ("failed (exitcode: N) local_rank: ...") without
    the traceback of torchrun's own join, which says nothing more; as for a subprocess worker. A worker that
    raised keeps its traceback, the worker's own."""
    if record.exc_info and isinstance(record.exc_info[1], torch.multiprocessing.ProcessExitedException):
        record.exc_info, record.exc_text = None, None
    return True
