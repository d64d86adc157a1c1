"""Starting several processes through torch's own elastic launcher (torchrun)."""

from __future__ import annotations

import os
import signal
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

from paratrain.errors import EXIT_NONFINITE, EXIT_REQUEUE, EXIT_SAVE_FAILED, ConfigError

# torchrun's own handling (stop the workers with the same signal, then raise) for these; SIGTERM and
# SIGUSR1 are paratrain's (_StopRequests), so that the workers get time to save a checkpoint.
_TORCHRUN_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"
# How often torchrun's agent looks at its workers (torch's default 0.1 s): a worker's death, and the end of a
# run, are seen that much sooner. Each look checks the workers' exit status and the rendezvous's cached state.
MONITOR_INTERVAL_S = 0.02


@dataclass(frozen=True)
class LaunchOptions:
    """How many processes, where, and how often the launcher restarts a failed group."""

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    max_restarts: int = 0

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def validate(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1 or self.max_restarts < 0:
            raise ConfigError("--nproc-per-node and --nnodes must be >= 1, --max-restarts >= 0")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigError(
                f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT of node 0, the same on every node"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} must be between 0 and --nnodes - 1 = {self.nnodes - 1}")


def torchrun_argv(
    options: LaunchOptions, worker_args: list[str], *, worker_module: str = "paratrain.worker"
) -> list[str]:
    """torchrun's arguments for running ``python -m WORKER_MODULE WORKER_ARGS`` on this node."""
    # lazy: torchrun's modules load only once the launch is decided (not for a one-process run)
    from paratrain.launch.rendezvous import BACKEND_NAME, LOOPBACK_ADDR  # loads torch.distributed.elastic

    argv = [
        "--nproc-per-node",
        str(options.nproc_per_node),
        "--nnodes",
        str(options.nnodes),
        "--max-restarts",
        str(options.max_restarts),
        "--signals-to-handle",
        _TORCHRUN_SIGNALS,
        "--monitor-interval",
        str(MONITOR_INTERVAL_S),
    ]
    if options.nnodes == 1:
        # Like --standalone, but every store listens on loopback only (see paratrain.launch.rendezvous).
        argv += [
            "--rdzv-backend",
            BACKEND_NAME,
            "--rdzv-endpoint",
            f"{LOOPBACK_ADDR}:0",
            "--rdzv-id",
            uuid.uuid4().hex,
            "--local-addr",
            LOOPBACK_ADDR,
        ]
    else:
        argv += [
            "--rdzv-backend",
            "static",
            "--rdzv-endpoint",
            options.rdzv_endpoint,
            "--node-rank",
            str(options.node_rank),
        ]
    return argv + ["-m", worker_module, *worker_args]


def launch(
    options: LaunchOptions,
    worker_args: list[str],
    *,
    env: dict[str, str],
    worker_module: str = "paratrain.worker",
    preload: Sequence[str] = (),
) -> int:
    """Runs the workers (``python -m WORKER_MODULE WORKER_ARGS``) under torchrun in this process; returns
    an exit code for the CLI. Other worker modules get the same loopback-only stores (tests use them).
    ``preload``: modules the workers import beyond WORKER_MODULE, imported once where workers are forked."""
    # lazy: torchrun's modules load only once the launch is decided (not for a one-process run)
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # lazy: torchrun's modules load only once the launch is decided (not for a one-process run)
    from paratrain.launch.forked_workers import forks_workers, run_workers
    from paratrain.launch.preemption import LAUNCHER_PID_ENV
    from paratrain.launch.rendezvous import LOOPBACK_ENV, register_loopback_rendezvous

    os.environ.update(env)
    if options.nnodes == 1:
        register_loopback_rendezvous()
        os.environ.update(LOOPBACK_ENV)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    args = get_args_parser().parse_args(torchrun_argv(options, worker_args, worker_module=worker_module))
    requests = _StopRequests.install()
    try:
        if forks_workers():
            run_workers(args, worker_module, worker_args, preload=preload)
        else:
            run(args)
    except ChildFailedError as error:
        return _summarise_failure(error)
    except (SignalException, _WorkersStopped):
        if requests.signal_name is None:  # SIGINT and the like: torchrun's, reported as it reports them
            raise
        print(
            f"paratrain: stopped on {requests.signal_name} (exit code {EXIT_REQUEUE}): requeue the job and "
            f"checkpoint.resume=auto continues from the newest complete checkpoint",
            file=sys.stderr,
        )
        return EXIT_REQUEUE
    return 0


class _WorkersStopped(Exception):
    """The workers agreed to stop, saved a checkpoint and are about to exit with EXIT_REQUEUE."""


@dataclass
class _StopRequests:
    """The launcher's side of stopping for a requeue (the workers' side: paratrain.launch.preemption).

    SIGTERM or SIGUSR1 to the launcher raises torchrun's SignalException, on which torchrun passes the
    signal to the workers and waits for them (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default) before
    killing them. A stop the workers agreed on by themselves (a signal sent to a worker) arrives as
    their notice, raised as _WorkersStopped before any worker exits: torchrun restarts a group whose
    workers exited non-zero, but never one it is told to shut down.
    """

    signal_name: str | None = None

    @classmethod
    def install(cls) -> _StopRequests:
        # lazy: torchrun's modules load only once the launch is decided (not for a one-process run)
        from paratrain.launch.preemption import STOP_SIGNALS, STOPPED_NOTICE

        requests = cls()
        for signum in STOP_SIGNALS:
            signal.signal(signum, requests._on_stop_signal)
        signal.signal(STOPPED_NOTICE, requests._on_stopped_notice)
        return requests

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        from torch.distributed.elastic.multiprocessing import SignalException  # lazy: as in launch()

        if self.signal_name is None:  # a repeat must not cut short torchrun's wait for the workers' checkpoint
            self.signal_name = signal.Signals(signum).name
            raise SignalException(f"paratrain launcher got {self.signal_name}", sigval=signal.Signals(signum))

    def _on_stopped_notice(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is None:
            self.signal_name = "the workers' own request (a signal to a worker, or a lighthouse gone for good)"
            raise _WorkersStopped()


def _summarise_failure(error) -> int:
    """One line per failed rank instead of torchrun's traceback; the workers printed the cause."""
    if error.failures and all(failure.exitcode == EXIT_REQUEUE for failure in error.failures.values()):
        print(f"paratrain: every worker stopped for a requeue (exit code {EXIT_REQUEUE})", file=sys.stderr)
        return EXIT_REQUEUE
    if _all_stopped_with(error, EXIT_NONFINITE):
        print(f"paratrain: every worker stopped on non-finite values (exit code {EXIT_NONFINITE})", file=sys.stderr)
        return EXIT_NONFINITE
    if _all_stopped_with(error, EXIT_SAVE_FAILED):
        return EXIT_SAVE_FAILED  # rank 0 said which checkpoint failed, why, and which one a resume uses
    codes = []
    for rank, failure in sorted(error.failures.items()):
        how = (
            f"killed by {signal.Signals(-failure.exitcode).name}"
            if failure.exitcode < 0
            else f"exit code {failure.exitcode}"
        )
        print(f"paratrain: rank {rank} failed ({how})", file=sys.stderr)
        codes.append(failure.exitcode)
    first = codes[0] if codes else 1
    return 128 - first if first < 0 else first


def _all_stopped_with(error, code: int) -> bool:
    """Whether the workers agreed to exit with ``code``. A worker still closing its process group when the
    first one exited is stopped by torchrun with SIGTERM: that is no failure of its own."""
    codes = {failure.exitcode for failure in error.failures.values()}
    return code in codes and codes <= {code, -signal.SIGTERM}
