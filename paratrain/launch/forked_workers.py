"""Workers forked from one process that imported them, not started as fresh interpreters.

torchrun starts each worker as ``python -u -m paratrain.worker ARGS``: a new interpreter that spends about 2
CPU-s importing torch, DTensor, DCP and FSDP before it reads its config, on every start and on every restart
after a failure. torchelastic also takes a function for its workers (as ``torchrun --run-path`` does); with
multiprocessing's forkserver start method, one server process imports the worker's modules once
(``ForkedWorker.preload``) and every worker, restarts included, is a fork of it. The server is
single-threaded and never touches CUDA, so forking it is safe where forking the launcher (threads: the
rendezvous store) would not be.
"""

from __future__ import annotations

import argparse
import multiprocessing
from collections.abc import Callable
from dataclasses import dataclass

# torchrun's default port for the static rendezvous, which its run() sets before reading the arguments.
TORCHRUN_MASTER_PORT = 29500


@dataclass(frozen=True)
class ForkedWorker:
    """A worker as a function of its arguments, forked from a server that imported ``preload`` first.

    Attributes:
        entrypoint: Runs one worker; its exit code is the process's (``sys.exit``). A module-level function:
            the forkserver finds it by name.
        preload: Modules the server imports once, before its first fork (the worker's heavy imports).
    """

    entrypoint: Callable[..., None]
    preload: tuple[str, ...]


def run_forked(args: argparse.Namespace, worker: ForkedWorker) -> None:
    """torchrun's ``run(args)`` with ``worker`` in place of ``python -m MODULE``, given the same arguments;
    raises as run does (ChildFailedError, SignalException)."""
    # lazy: torchrun's modules load only once the launch is decided (not for a one-process run)
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    if args.master_port is None:
        args.master_port = TORCHRUN_MASTER_PORT
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    multiprocessing.set_forkserver_preload(list(worker.preload))
    elastic_launch(config=config, entrypoint=worker.entrypoint)(*args.training_script_args)
