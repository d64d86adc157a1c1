"""Start-up and exit: a 1-step ``ddp`` x2 run of the quickstart, launch to process exit, against torchrun.

The paratrain side is ``paratrain.cli train examples/quickstart.yaml --nproc-per-node 2`` with one step;
the other is ``python -m torch.distributed.run --standalone --nproc-per-node 2`` running the plain DDP
loop of benchmarks/handwritten_ddp.py on the same model (the quickstart's GPT), data, global and
micro batch. Neither writes a checkpoint (``checkpoint.save_final=false``): the plain loop has none.
Both are whole processes timed from just before the launcher starts:

- *exit*: until the launcher has exited (every worker torn down);
- *first step*: until the ``time`` of the step-1 record in ``metrics.jsonl``.

and, beside them, *CPU*: the user + system seconds of the whole process tree (launcher and workers), the
work each side does, which other engineers' jobs on a shared machine stretch far less than wall time.

The runs alternate (P H, H P, ...) on a shared machine; the ratio to read is the median of per-round
ratios. It prints, it never asserts; results belong in docs/benchmarks.md.

    .venv/bin/python benchmarks/startup.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ddp_overhead import Side, Workload, round_order, run_job  # noqa: E402

# The quickstart's model and batches (examples/quickstart.yaml); one step, logged.
QUICKSTART = Workload(steps=1, log_every=1, global_batch_size=32, micro_batch_size=8, n_embd=96)


def run_once(side: Side, out_dir: Path, *, timeout_s: float) -> tuple[float, float, float]:
    """(launch to exit, launch to the step-1 record, CPU seconds of the process tree) of one run."""
    argv = QUICKSTART.argv(side, out_dir)
    cpu_before = children_cpu_s()
    launched = time.time()
    returncode, output = run_job(argv, timeout_s=timeout_s)
    exited = time.time()
    cpu_s = children_cpu_s() - cpu_before
    if returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} exited with {returncode}:\n{output[-4000:]}")
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(record for record in records if record["step"] == 1)
    return exited - launched, first["time"] - launched, cpu_s


def children_cpu_s() -> float:
    """User + system CPU seconds of every waited-for descendant so far (the launcher waits for its workers)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="pairs of runs, one of each side per round")
    parser.add_argument("--run-timeout", type=float, default=300)
    args = parser.parse_args()
    out_dir = Path(tempfile.mkdtemp(prefix="startup-"))
    print("paratrain:", shlex.join(QUICKSTART.paratrain_argv(out_dir / "round-N-paratrain")))
    print("torchrun: ", shlex.join(QUICKSTART.handwritten_argv(out_dir / "round-N-handwritten")))
    print("| round | order | exit P s | exit H s | exit ratio | first step P s | first step H s | CPU P s | CPU H s |")
    print("|---|---|---|---|---|---|---|---|---|")
    exits: dict[Side, list[float]] = {"paratrain": [], "handwritten": []}
    firsts: dict[Side, list[float]] = {"paratrain": [], "handwritten": []}
    cpus: dict[Side, list[float]] = {"paratrain": [], "handwritten": []}
    for index in range(args.rounds):
        for side in round_order(index):
            exit_s, first_s, cpu_s = run_once(side, out_dir / f"round-{index + 1}-{side}", timeout_s=args.run_timeout)
            exits[side].append(exit_s)
            firsts[side].append(first_s)
            cpus[side].append(cpu_s)
        order = " ".join(side[0].upper() for side in round_order(index))
        p_exit, h_exit = exits["paratrain"][-1], exits["handwritten"][-1]
        print(
            f"| {index + 1} | {order} | {p_exit:.2f} | {h_exit:.2f} | {p_exit / h_exit:.3f} | "
            f"{firsts['paratrain'][-1]:.2f} | {firsts['handwritten'][-1]:.2f} | "
            f"{cpus['paratrain'][-1]:.2f} | {cpus['handwritten'][-1]:.2f} |",
            flush=True,
        )
    exit_ratios = [p / h for p, h in zip(exits["paratrain"], exits["handwritten"], strict=True)]
    first_ratios = [p / h for p, h in zip(firsts["paratrain"], firsts["handwritten"], strict=True)]
    cpu_ratios = [p / h for p, h in zip(cpus["paratrain"], cpus["handwritten"], strict=True)]
    print(
        f"median launch to exit: paratrain {statistics.median(exits['paratrain']):.2f} s, "
        f"torchrun {statistics.median(exits['handwritten']):.2f} s; median per-round ratio "
        f"{statistics.median(exit_ratios):.3f} (the goal: <= 1.1)"
    )
    print(
        f"median launch to first step: paratrain {statistics.median(firsts['paratrain']):.2f} s, "
        f"torchrun {statistics.median(firsts['handwritten']):.2f} s; median per-round ratio "
        f"{statistics.median(first_ratios):.3f}"
    )
    print(
        f"median CPU of the process tree: paratrain {statistics.median(cpus['paratrain']):.2f} s, "
        f"torchrun {statistics.median(cpus['handwritten']):.2f} s; median per-round ratio "
        f"{statistics.median(cpu_ratios):.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
