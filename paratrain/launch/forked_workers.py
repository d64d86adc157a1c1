"""Workers forked from a process that has already imported torch and paratrain, instead of each importing them.

Each of torchrun's workers would otherwise start a fresh interpreter and import torch, DTensor, DCP and
paratrain: about 2 CPU-s a process, paid again by every restart torchrun makes after a failure. torchrun
starts a worker as a function too, through ``multiprocessing``; with the ``forkserver`` start method the
server imports those modules once (``PRELOADED``) and each worker is a fork of it, its imports done. The
server is a fresh single-threaded interpreter started by the launcher, so a fork copies no launcher thread
and no launcher state. A worker then starts as its own interpreter would: ``python -u -m MODULE ARGS``,
the stop signals delivered, multiprocessing's default start method and the exit functions run at its end
(torchrun sets ``OMP_NUM_THREADS`` in the launcher before the server starts and imports torch).

Only where torch has no GPU runtime: the CUDA runtime must not have been initialised in a process that forks,
and an availability check made while importing would do that; a GPU build starts each worker as a
subprocess, as torchrun does.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import multiprocessing
import multiprocessing.forkserver
import runpy
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from paratrain.launch.preemption import STOP_SIGNALS

START_METHOD = "forkserver"
# The module every paratrain worker runs (the launcher's default); it imports what training needs.
PRELOADED = ["paratrain.worker"]


def forks_workers() -> bool:
    """Whether this torch build has no GPU runtime (CUDA, ROCm or XPU) whose initialisation a fork could copy."""
    return not torch.backends.cuda.is_built() and not torch.xpu._is_compiled()


def run_workers(args: argparse.Namespace, worker_module: str, worker_args: list[str]) -> None:
    """torchrun's ``run(args)``, whose script is ``-m WORKER_MODULE WORKER_ARGS``, with its workers forked."""
    from torch.distributed.launcher.api import elastic_launch  # lazy: torchrun's modules, as in launcher.py
    from torch.distributed.run import config_from_args

    if args.master_port is None:  # as torchrun's run(): read by the static rendezvous only
        args.master_port = 29500
    config, _, _ = config_from_args(args)
    config.start_method = START_METHOD
    multiprocessing.set_forkserver_preload(PRELOADED)
    with stop_signals_blocked():
        multiprocessing.forkserver.ensure_running()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_without_join_traceback)
    try:
        elastic_launch(config=config, entrypoint=run_module_as_main)(worker_module, *worker_args)
    finally:
        _stop_server()


def _stop_server() -> None:
    """Ends the fork server and waits for it. It would end by itself once the launcher has, but then as an
    orphan: its own and its workers' CPU time would count for no process tree, and it would outlive the
    launcher by a moment. (``_stop`` is multiprocessing's one way to reach the server it started.)"""
    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


@contextmanager
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
