"""``python -m tests.launch_workers NPROC MODULE [ARGS...]``: runs ``python -m MODULE ARGS`` on NPROC
processes through paratrain's own launcher, so test workers get the loopback-only stores that
``paratrain train`` uses (torchrun's ``--standalone`` store listens on every interface)."""

import sys

from paratrain.launch.launcher import LaunchOptions, launch

if __name__ == "__main__":
    nproc, module, *worker_args = sys.argv[1:]
    sys.exit(launch(LaunchOptions(nproc_per_node=int(nproc)), worker_args, env={}, worker_module=module))
