"""Per-rank model-state bytes, peak resident memory and step time of paratrain ``fsdp`` against
``ddp``, at each world size asked for.

Model state is parameters + gradients + AdamW state (exp_avg, exp_avg_sq and the scalar ``step``
counters), counted from the tensors each rank holds locally after a few steps (see
``fsdp_memory_worker.py``). The ZeRO target: fsdp on N ranks holds at most (ddp's bytes / N) x 1.05.

The machine is shared and noisy, so the layouts alternate within one invocation (round 1: ddp fsdp,
round 2: fsdp ddp, ...) and each round's fsdp/ddp step-time ratio is what to read; the summary gives
the median ratio over rounds. Byte counts do not depend on the noise. This prints, it never asserts:
results belong in docs/benchmarks-fsdp.md.

    .venv/bin/python benchmarks/fsdp_memory.py --world-sizes 2 4 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER = Path("benchmarks") / "fsdp_memory_worker.py"
TARGET = 1.05  # fsdp bytes per rank may exceed ddp's / N by at most 5 %

# Layouts by name: the worker's --strategy and any extra config overrides.
LAYOUTS = {
    "ddp": ("ddp", []),
    "fsdp": ("fsdp", []),
    "fsdp-no-reshard": ("fsdp", ["parallel.fsdp.reshard_after_forward=false"]),
}
STATE_PARTS = ("params", "grads", "optim_moments", "optim_steps")


@dataclass(frozen=True)
class Workload:
    """The training job every run does; the global batch is cut into one micro-batch per rank."""

    global_batch_size: int = 32
    warmup_steps: int = 3
    timed_steps: int = 10
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 8
    n_embd: int = 256

    def worker_argv(self, layout: str, *, nproc: int, out: Path, run_dir: Path) -> list[str]:
        strategy, overrides = LAYOUTS[layout]
        options = {
            "strategy": strategy,
            "out": out,
            "output-dir": run_dir,
            "warmup-steps": self.warmup_steps,
            "timed-steps": self.timed_steps,
            "global-batch-size": self.global_batch_size,
            "micro-batch-size": self.global_batch_size // nproc,
            "block-size": self.block_size,
            "n-layer": self.n_layer,
            "n-head": self.n_head,
            "n-embd": self.n_embd,
        }
        flags = [item for name, value in options.items() for item in (f"--{name}", str(value))]
        flags += [item for override in overrides for item in ("--override", override)]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            str(WORKER),
            *flags,
        ]


@dataclass(frozen=True)
class RunResult:
    """One run of one layout, reduced over its ranks: the worst rank for memory, the slowest rank
    for each step's time."""

    params_numel: int
    logical_bytes: dict[str, int]  # per part of STATE_PARTS, max over ranks
    storage_bytes: dict[str, int]
    grad_tensors: int
    grad_storages: int  # 1 for DDP's single bucket (gradients are views into it), one per FSDP group
    peak_rss_kib: int
    rss_after_kib: int
    rss_before_trainer_kib: int
    step_s: float  # median over timed steps of the slowest rank's time
    fastest_step_s: float  # the step the machine's other load disturbed least

    @property
    def total_logical(self) -> int:
        return sum(self.logical_bytes.values())

    @property
    def total_storage(self) -> int:
        return sum(self.storage_bytes.values())


def reduce_ranks(result: dict) -> RunResult:
    ranks = result["ranks"]

    def worst(part: str, kind: str) -> int:
        return max(rank["bytes"][part][kind] for rank in ranks)

    grads = ranks[0]["bytes"]["grads"]
    slowest_per_step = [max(times) for times in zip(*(rank["step_times_s"] for rank in ranks))]
    return RunResult(
        params_numel=ranks[0]["params_numel"],
        logical_bytes={part: worst(part, "logical") for part in STATE_PARTS},
        storage_bytes={part: worst(part, "storage") for part in STATE_PARTS},
        grad_tensors=grads["num_tensors"],
        grad_storages=grads["num_storages"],
        peak_rss_kib=max(rank["peak_rss_kib"] for rank in ranks),
        rss_after_kib=max(rank["rss_after_kib"] for rank in ranks),
        rss_before_trainer_kib=max(rank["rss_before_trainer_kib"] for rank in ranks),
        step_s=statistics.median(slowest_per_step),
        fastest_step_s=min(slowest_per_step),
    )


def run_worker(argv: list[str], out: Path, *, timeout_s: float, extra_env: dict[str, str]) -> RunResult:
    """Runs one torchrun job and reads rank 0's JSON.

    Raises:
        RuntimeError: the job failed or timed out; its output's tail is included.
    """
    # PYTHONPATH: import paratrain from the tree this script lies in, not wherever the venv points.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), **extra_env}
    launcher = subprocess.Popen(
        argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output = launcher.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        # SIGTERM lets torchrun stop its workers, which run in sessions of their own.
        launcher.terminate()
        output = launcher.communicate(timeout=60)[0]
        raise RuntimeError(f"{shlex.join(argv)} timed out after {timeout_s:.0f} s:\n{output[-4000:]}") from None
    if launcher.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} exited with {launcher.returncode}:\n{output[-4000:]}")
    return reduce_ranks(json.loads(out.read_text()))


def round_order(layouts: list[str], round_index: int) -> list[str]:
    """The layouts rotated by one each round, so none always runs first (e.g. on a cold page cache)."""
    shift = round_index % len(layouts)
    return layouts[shift:] + layouts[:shift]


def run_world_size(
    workload: Workload,
    layouts: list[str],
    *,
    nproc: int,
    rounds: int,
    out_dir: Path,
    timeout_s: float,
    extra_env: dict[str, str],
) -> list[dict[str, RunResult]]:
    """Alternating runs of every layout at one world size; prints a line per run as it finishes."""
    results = []
    for index in range(rounds):
        measured = {}
        for layout in round_order(layouts, index):
            run_dir = out_dir / f"n{nproc}-round{index + 1}-{layout}"
            out = run_dir.with_suffix(".json")
            argv = workload.worker_argv(layout, nproc=nproc, out=out, run_dir=run_dir)
            measured[layout] = run_worker(argv, out, timeout_s=timeout_s, extra_env=extra_env)
            print_run(nproc, index, layout, measured[layout])
        results.append(measured)
    return results


def print_run(nproc: int, index: int, layout: str, run: RunResult) -> None:
    print(
        f"N={nproc} round {index + 1} {layout:<16} state {run.total_logical / 2**20:8.2f} MiB  "
        f"peak RSS {run.peak_rss_kib / 1024:7.1f} MiB  step {run.step_s * 1e3:7.1f} ms",
        flush=True,
    )


def summary_rows(nproc: int, layouts: list[str], results: list[dict[str, RunResult]]) -> list[str]:
    """One markdown table row per layout at this world size; ratios are against ddp of each round."""
    baseline = [measured["ddp"] for measured in results]
    rows = []
    for layout in layouts:
        runs = [measured[layout] for measured in results]
        run, ddp = runs[-1], baseline[-1]  # byte counts are the same in every round
        bytes_ratio = run.total_logical / (ddp.total_logical / nproc)
        storage_ratio = run.total_storage / (ddp.total_storage / nproc)
        step_ratios = [mine.step_s / base.step_s for mine, base in zip(runs, baseline)]
        fastest_ratios = [mine.fastest_step_s / base.fastest_step_s for mine, base in zip(runs, baseline)]
        cells = [
            str(nproc),
            layout,
            f"{run.params_numel:,}",
            *(f"{run.logical_bytes[part]:,}" for part in STATE_PARTS),
            f"{run.total_logical:,}",
            f"{bytes_ratio:.6f}",
            f"{storage_ratio:.6f}",
            f"{statistics.median(r.peak_rss_kib for r in runs) / 1024:.0f}",
            f"{statistics.median(r.rss_after_kib - r.rss_before_trainer_kib for r in runs) / 1024:.0f}",
            f"{statistics.median(r.step_s for r in runs) * 1e3:.0f}",
            _ratio_cell(step_ratios),
            _ratio_cell(fastest_ratios),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _ratio_cell(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


TABLE_HEADER = (
    "| N | layout | Ψ | params B | grads B | Adam moments B | Adam step B | total B | ÷ (ddp/N) | "
    "storage ÷ (ddp/N) | peak RSS MiB | RSS growth MiB | step ms | step ÷ ddp | fastest step ÷ ddp |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def print_summary(rows: list[str], checks: list[str]) -> None:
    print("\nPer rank, max over ranks. Bytes after the last step (gradients still held); RSS and step")
    print("times are medians over rounds; 'RSS growth' is resident memory after the run minus before")
    print("the Trainer was built; step ratios are per round (median step, and fastest step, of each run),")
    print("shown as median over rounds (min-max).\n")
    print(TABLE_HEADER)
    print("\n".join(rows))
    print()
    print("\n".join(checks))


def target_check(nproc: int, results: list[dict[str, RunResult]]) -> list[str]:
    fsdp, ddp = results[-1]["fsdp"], results[-1]["ddp"]
    ratio = fsdp.total_logical / (ddp.total_logical / nproc)
    verdict = "meets" if ratio <= TARGET else "MISSES"
    zero3 = 16 * fsdp.params_numel / nproc
    verdict_line = (
        f"N={nproc}: fsdp {fsdp.total_logical:,} B vs ddp/N {ddp.total_logical / nproc:,.0f} B: "
        f"ratio {ratio:.6f}, {verdict} the target <= {TARGET} (16Ψ/N = {zero3:,.0f} B)"
    )
    storage_line = (
        f"N={nproc}: gradients live in {ddp.grad_storages} storage(s) for {ddp.grad_tensors} tensors "
        f"under ddp, {fsdp.grad_storages} for {fsdp.grad_tensors} under fsdp"
    )
    return [verdict_line, storage_line]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per world size")
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=["ddp", "fsdp"],
        choices=sorted(LAYOUTS),
        help="layouts to compare; ddp and fsdp are always included",
    )
    parser.add_argument("--global-batch-size", type=int, default=32, help="samples per step over all ranks")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--timed-steps", type=int, default=10)
    parser.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        metavar="BYTES",
        help="set glibc's MALLOC_MMAP_THRESHOLD_ in the workers: freed large blocks then go back "
        "to the OS, so RSS follows live memory instead of the allocator's high-water mark",
    )
    parser.add_argument("--run-timeout", type=float, default=600, help="seconds before a run counts as hung")
    parser.add_argument("--out-dir", type=Path, help="where runs write (default: a new temporary directory)")
    return parser.parse_args()


def malloc_env(threshold: int | None) -> dict[str, str]:
    # A fixed threshold also stops glibc's default of raising it each time a large block is freed.
    return {"MALLOC_MMAP_THRESHOLD_": str(threshold)} if threshold else {}


def print_header(workload: Workload, extra_env: dict[str, str]) -> None:
    print("command:", shlex.join([Path(sys.executable).name, *sys.argv]))
    print("worker: ", shlex.join(workload.worker_argv("fsdp", nproc=2, out=Path("OUT.json"), run_dir=Path("RUN_DIR"))))
    print(f"OMP_NUM_THREADS=1, gloo, {os.cpu_count()} CPU cores visible, extra environment: {extra_env or 'none'}\n")


def main() -> int:
    args = parse_args()
    layouts = ["ddp", "fsdp", *(name for name in args.layouts if name not in ("ddp", "fsdp"))]
    workload = Workload(
        global_batch_size=args.global_batch_size, warmup_steps=args.warmup_steps, timed_steps=args.timed_steps
    )
    out_dir = (args.out_dir or Path(tempfile.mkdtemp(prefix="fsdp_memory-"))).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    extra_env = malloc_env(args.malloc_mmap_threshold)
    print_header(workload, extra_env)
    rows, checks = [], []
    for nproc in args.world_sizes:
        results = run_world_size(
            workload,
            layouts,
            nproc=nproc,
            rounds=args.rounds,
            out_dir=out_dir,
            timeout_s=args.run_timeout,
            extra_env=extra_env,
        )
        rows += summary_rows(nproc, layouts, results)
        checks += target_check(nproc, results)
    print_summary(rows, checks)
    print(f"\nruns kept in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
