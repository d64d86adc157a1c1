"""Starting several processes through torch's own elastic launcher (torchrun)."""

from __future__ import annotations

import os
import signal
import sys
import uuid
from dataclasses import dataclass

from paratrain.errors import ConfigError


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
            raise ConfigError(f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT of node 0, the same on every node")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} must be between 0 and --nnodes - 1 = {self.nnodes - 1}")


def torchrun_argv(options: LaunchOptions, worker_args: list[str]) -> list[str]:
    """torchrun's arguments for running ``python -m paratrain.train WORKER_ARGS`` on this node."""
    from paratrain.rendezvous import BACKEND_NAME, LOOPBACK_ADDR  # loads torch.distributed.elastic

    argv = ["--nproc-per-node", str(options.nproc_per_node), "--nnodes", str(options.nnodes),
            "--max-restarts", str(options.max_restarts)]
    if options.nnodes == 1:
        # Like --standalone, but every store listens on loopback only (see paratrain.rendezvous).
        argv += ["--rdzv-backend", BACKEND_NAME, "--rdzv-endpoint", f"{LOOPBACK_ADDR}:0", "--rdzv-id", uuid.uuid4().hex,
                 "--local-addr", LOOPBACK_ADDR]
    else:
        argv += ["--rdzv-backend", "static", "--rdzv-endpoint", options.rdzv_endpoint, "--node-rank", str(options.node_rank)]
    return argv + ["-m", "paratrain.train", *worker_args]


def launch(options: LaunchOptions, worker_args: list[str], *, env: dict[str, str]) -> int:
    """Runs the workers under torchrun in this process; returns an exit code for the CLI."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from paratrain.rendezvous import LOOPBACK_ENV, register_loopback_rendezvous

    os.environ.update(env)
    if options.nnodes == 1:
        register_loopback_rendezvous()
        os.environ.update(LOOPBACK_ENV)
    args = get_args_parser().parse_args(torchrun_argv(options, worker_args))
    try:
        run(args)
    except ChildFailedError as error:
        return _summarise_failure(error)
    return 0


def _summarise_failure(error) -> int:
    """One line per failed rank instead of torchrun's traceback; the workers printed the cause."""
    codes = []
    for rank, failure in sorted(error.failures.items()):
        how = f"killed by {signal.Signals(-failure.exitcode).name}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        print(f"paratrain: rank {rank} failed ({how})", file=sys.stderr)
        codes.append(failure.exitcode)
    first = codes[0] if codes else 1
    return 128 - first if first < 0 else first
