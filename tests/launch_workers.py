"""``python -m tests.launch_workers NPROC MODULE [ARGS...]``: runs ``python -m MODULE ARGS`` on NPROC
processes through paratrain's own launcher, so test workers get the loopback-only stores that
``paratrain train`` uses (torchrun's ``--standalone`` store listens on every interface)."""

import sys

from paratrain.launch.launcher import LaunchOptions, launch

# A module no test worker imports itself, imported for them as replica groups' workers get torchft: a worker
# finds it imported as it starts only where its fork server preloaded it (tests/integration/forked_worker_probe.py).
PRELOADED_FOR_THE_WORKERS = ("wave",)

if __name__ == "__main__":
    nproc, module, *worker_args = sys.argv[1:]
    options = LaunchOptions(nproc_per_node=int(nproc))
    sys.exit(launch(options, worker_args, env={}, worker_module=module, preload=PRELOADED_FOR_THE_WORKERS))
