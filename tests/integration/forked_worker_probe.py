"""``python -m tests.integration.forked_worker_probe OUT_DIR EXIT_CODE``, run by paratrain's launcher: each rank
writes what a worker finds as it starts (test_launch.py compares it with a fresh interpreter's), registers an
exit function that leaves a file, and rank 1 exits with EXIT_CODE."""

import atexit
import json
import multiprocessing
import os
import signal
import sys
from pathlib import Path

# Before anything below imports it: imported already only where the worker is a fork of the server.
IMPORTED_BEFORE_START = "paratrain.train" in sys.modules
PRELOADED_BEFORE_START = "wave" in sys.modules  # tests/launch_workers.py's PRELOADED_FOR_THE_WORKERS


def files_open() -> list[str]:
    """The regular files this process holds open (the listing's own descriptor is gone once listed)."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:
            continue
    return sorted(target for target in targets if os.path.isfile(target))


if __name__ == "__main__":
    import torch

    out_dir, exit_code = Path(sys.argv[1]), int(sys.argv[2])
    rank = int(os.environ["RANK"])
    found = {
        "imported_before_start": IMPORTED_BEFORE_START,
        "preloaded_before_start": PRELOADED_BEFORE_START,
        "argv": sys.argv[1:],
        "start_method": multiprocessing.get_start_method(),
        "blocked_signals": sorted(int(blocked) for blocked in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "threads": torch.get_num_threads(),
        "line_buffered": sys.stdout.line_buffering and sys.stderr.line_buffering,
        "handlers_installed": [  # Python handlers beyond the interpreter's own (SIGINT's, where not ignored)
            signal.Signals(signum).name
            for signum in signal.valid_signals()
            if callable(signal.getsignal(signum)) and signal.getsignal(signum) is not signal.default_int_handler
        ],
        "files_open": files_open(),
    }
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(found))
    atexit.register((out_dir / f"exited-{rank}").touch)
    sys.exit(exit_code if rank == 1 else 0)
