"""Per-step time of paratrain ``ddp`` against a hand-written torch DDP loop doing the same work.

Both train the same GPT from the same initial weights on the same data, sample order and global
batch (2 processes, gloo, one thread each) and write the same ``metrics.jsonl``; the table says
whether their losses came out bit-identical, the check that the work really was the same. The
machine is shared and noisy, so absolute times mean little: the runs alternate within one
invocation and each round's two runs sit side by side, which makes their ratio the number to read.
The order flips every round (P H, H P, P H, ...) so that neither side always runs second.

Per-step time of a run: the median over its log windows after ``--skip-until-step`` of the window's
mean step time (paratrain's ``step_time_s``); "best" is the fastest such window, the one the
machine's other load disturbed least. Launch to first step: wall time from just before the launcher
process starts to the ``time`` of the step-1 record (imports, process group, model and data build,
and step 1 itself). ``--control`` runs the hand-written loop in both columns: its ratios show how far
noise alone moves a ratio on this machine. Results belong in docs/benchmarks.md, not in tests:
this prints, it never asserts.

Both sides import paratrain from the tree this file lies in, so it can measure a snapshot
(``git archive``) while the checkout itself is being edited:

    .venv/bin/python benchmarks/ddp_overhead.py --rounds 5
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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

REPO_ROOT = Path(__file__).resolve().parent.parent
HANDWRITTEN_SCRIPT = REPO_ROOT / "benchmarks" / "handwritten_ddp.py"
NPROC = 2

Side = Literal["paratrain", "handwritten"]


@dataclass(frozen=True)
class Workload:
    """The training job both sides run; every value is passed explicitly to both."""

    steps: int
    log_every: int = 10
    global_batch_size: int = 64  # 64 / (16 x 2 ranks) = 2 micro-batches per rank: accumulation runs
    micro_batch_size: int = 16
    seed: int = 0
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 20
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64

    def paratrain_argv(self, out_dir: Path) -> list[str]:
        model_args = (
            f"{{block_size: {self.block_size}, n_layer: {self.n_layer}, n_head: {self.n_head}, n_embd: {self.n_embd}}}"
        )
        overrides = [
            f"run.output_dir={out_dir}",
            f"train.max_steps={self.steps}",
            f"train.seed={self.seed}",
            f"train.global_batch_size={self.global_batch_size}",
            f"train.micro_batch_size={self.micro_batch_size}",
            f"optim.lr={self.lr}",
            f"optim.weight_decay={self.weight_decay}",
            f"optim.warmup_steps={self.warmup_steps}",
            f"log.every_steps={self.log_every}",
            f"model.args={model_args}",
            f"data.args={{block_size: {self.block_size}}}",
            # No checkpoint is written, so the step times hold training alone.
            "checkpoint.save_final=false",
            "checkpoint.every_steps=0",
        ]
        return [
            sys.executable,
            "-m",
            "paratrain.cli",
            "train",
            "examples/quickstart.yaml",
            *overrides,
            "--nproc-per-node",
            str(NPROC),
        ]

    def handwritten_argv(self, out_dir: Path) -> list[str]:
        options = {
            "out-dir": out_dir,
            "steps": self.steps,
            "log-every": self.log_every,
            "seed": self.seed,
            "global-batch-size": self.global_batch_size,
            "micro-batch-size": self.micro_batch_size,
            "lr": self.lr,
            "weight-decay": self.weight_decay,
            "warmup-steps": self.warmup_steps,
            "block-size": self.block_size,
            "n-layer": self.n_layer,
            "n-head": self.n_head,
            "n-embd": self.n_embd,
        }
        flags = [item for name, value in options.items() for item in (f"--{name}", str(value))]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(NPROC),
            str(HANDWRITTEN_SCRIPT.relative_to(REPO_ROOT)),
            *flags,
        ]

    def argv(self, side: Side, out_dir: Path) -> list[str]:
        return self.paratrain_argv(out_dir) if side == "paratrain" else self.handwritten_argv(out_dir)


@dataclass(frozen=True)
class RunResult:
    """What one run measured."""

    step_s: float  # median of the window mean step times after the warm-up windows
    best_step_s: float  # the fastest such window: the one the machine's other load disturbed least
    launch_s: float  # launch to the step-1 record
    losses: dict[int, float]  # logged step -> loss, to check both sides did the same work


def run_once(argv: list[str], out_dir: Path, *, skip_until_step: int, timeout_s: float) -> RunResult:
    """Runs one training job to completion and reads its metrics.jsonl.

    Raises:
        RuntimeError: the job failed or timed out (its output is included), or it logged no window
            after the warm-up.
    """
    launched = time.time()
    returncode, output = run_job(argv, timeout_s=timeout_s)
    if returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} exited with {returncode}:\n{output[-4000:]}")
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [record["step_time_s"] for record in records if record["step"] > skip_until_step]
    if not steady:
        raise RuntimeError(f"no log window after step {skip_until_step}; raise --steps")
    first = next(record for record in records if record["step"] == 1)
    return RunResult(
        statistics.median(steady),
        min(steady),
        first["time"] - launched,
        {record["step"]: record["loss"] for record in records},
    )


def run_job(argv: list[str], *, timeout_s: float) -> tuple[int | str, str]:
    """(exit code or "timed out", stdout + stderr) of a launcher and the workers it starts."""
    # PYTHONPATH: both sides import paratrain from the tree this script lies in, also when that tree
    # is a snapshot and the venv's editable install points at a checkout being edited.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    launcher = subprocess.Popen(
        argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output = launcher.communicate(timeout=timeout_s)[0]
        return launcher.returncode, output
    except subprocess.TimeoutExpired:
        # SIGTERM lets torchrun stop its workers (it starts each in a session of its own, so they
        # would outlive a SIGKILL of the launcher alone).
        launcher.terminate()
        output = launcher.communicate(timeout=60)[0]
        return f"timed out after {timeout_s:.0f} s", output


def round_order(round_index: int) -> tuple[Side, Side]:
    return ("paratrain", "handwritten") if round_index % 2 == 0 else ("handwritten", "paratrain")


def run_rounds(
    workload: Workload, *, rounds: int, out_dir: Path, skip_until_step: int, timeout_s: float, control: bool
) -> list[dict[Side, RunResult]]:
    """Alternating runs of both sides; prints each round's line as soon as it is measured.

    With ``control`` the hand-written loop runs in both columns, so the ratios show the noise floor.
    """
    results = []
    for index in range(rounds):
        measured: dict[Side, RunResult] = {}
        for side in round_order(index):
            run_dir = out_dir / f"round-{index + 1}-{side}"
            argv = workload.argv("handwritten" if control else side, run_dir)
            measured[side] = run_once(argv, run_dir, skip_until_step=skip_until_step, timeout_s=timeout_s)
        results.append(measured)
        print_round(index, measured)
    return results


def print_header(workload: Workload, out_dir: Path, *, control: bool) -> None:
    if control:
        print("CONTROL RUN: the 'paratrain' column runs the hand-written loop too; its ratios are noise alone\n")
    first_side = workload.handwritten_argv if control else workload.paratrain_argv
    print("paratrain:  ", shlex.join(first_side(out_dir / "round-N-paratrain")))
    print("handwritten:", shlex.join(workload.handwritten_argv(out_dir / "round-N-handwritten")))
    print(f"OMP_NUM_THREADS=1 for both; {NPROC} processes, gloo\n")
    print(
        f"{'round':>5}  {'order':<5}  {'paratrain ms':>12}  {'handwritten ms':>14}  {'ratio':>6}  "
        f"{'best ratio':>10}  {'launch P s':>10}  {'launch H s':>10}  same losses"
    )


def print_round(index: int, measured: dict[Side, RunResult]) -> None:
    para, hand = measured["paratrain"], measured["handwritten"]
    order = "".join(side[0].upper() for side in round_order(index))
    print(
        f"{index + 1:>5}  {order:<5}  {para.step_s * 1e3:>12.1f}  {hand.step_s * 1e3:>14.1f}  "
        f"{para.step_s / hand.step_s:>6.3f}  {para.best_step_s / hand.best_step_s:>10.3f}  "
        f"{para.launch_s:>10.2f}  {hand.launch_s:>10.2f}  "
        f"{describe_loss_match(para.losses, hand.losses)}",
        flush=True,
    )


def describe_loss_match(para: dict[int, float], hand: dict[int, float]) -> str:
    """'yes' when both logged the same steps with bit-identical losses, else the largest difference."""
    if para.keys() != hand.keys():
        return f"no (logged steps differ: {sorted(para.keys() ^ hand.keys())})"
    worst = max(abs(para[step] - hand[step]) for step in para)
    return "yes" if worst == 0 else f"no (max |diff| {worst:.3g})"


def print_summary(results: list[dict[Side, RunResult]]) -> None:
    def median_of(side: Side, field: str) -> float:
        return statistics.median(getattr(measured[side], field) for measured in results)

    para_step, hand_step = median_of("paratrain", "step_s"), median_of("handwritten", "step_s")
    round_ratios = [measured["paratrain"].step_s / measured["handwritten"].step_s for measured in results]
    print(f"\nmedian step time: paratrain {para_step * 1e3:.1f} ms, handwritten {hand_step * 1e3:.1f} ms")
    print(f"ratio of medians (paratrain / handwritten): {para_step / hand_step:.3f}")
    print(
        f"median of per-round ratios: {statistics.median(round_ratios):.3f} "
        f"(min {min(round_ratios):.3f}, max {max(round_ratios):.3f})"
    )
    best_ratios = [measured["paratrain"].best_step_s / measured["handwritten"].best_step_s for measured in results]
    print(
        f"fastest-window ratio, median over rounds: {statistics.median(best_ratios):.3f} "
        f"(min {min(best_ratios):.3f}, max {max(best_ratios):.3f})"
    )
    launch_p, launch_h = median_of("paratrain", "launch_s"), median_of("handwritten", "launch_s")
    print(f"median launch to first step: paratrain {launch_p:.2f} s, handwritten {launch_h:.2f} s")
    print(f"launch-to-first-step ratio (paratrain / handwritten): {launch_p / launch_h:.3f} (the goal: <= 1.2)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="pairs of runs, one of each side per round")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per run")
    parser.add_argument("--log-every", type=int, default=10, help="steps per log window")
    parser.add_argument(
        "--skip-until-step", type=int, default=20, help="windows ending at or before this step are warm-up"
    )
    parser.add_argument("--run-timeout", type=float, default=300, help="seconds before a run counts as hung")
    parser.add_argument(
        "--control",
        action="store_true",
        help="run the hand-written loop on both sides, to measure the noise floor of the ratio",
    )
    parser.add_argument("--out-dir", type=Path, help="where the runs write (default: a new temporary directory)")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    out_dir = (args.out_dir or Path(tempfile.mkdtemp(prefix="ddp_overhead-"))).resolve()
    if out_dir.exists() and any(out_dir.iterdir()):
        # Both sides append to metrics.jsonl, so an old run's lines would be read as this one's.
        raise SystemExit(f"--out-dir {out_dir} is not empty; pass a new or empty directory")
    workload = Workload(steps=args.steps, log_every=args.log_every)
    print_header(workload, out_dir, control=args.control)
    results = run_rounds(
        workload,
        rounds=args.rounds,
        out_dir=out_dir,
        skip_until_step=args.skip_until_step,
        timeout_s=args.run_timeout,
        control=args.control,
    )
    print_summary(results)
    print(f"\nruns kept in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
