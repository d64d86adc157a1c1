"""Chaos soak: SIGKILL a random worker at a random step, again and again, and check that the run
still ends with exactly the weights of an uninterrupted run.

One ``paratrain train --nproc-per-node N --max-restarts K`` run of a tiny GPT (checkpoint every
``--every`` steps, every step logged) is attacked by an outside killer: this script reads the
launcher's stderr as it comes, and for each attempt of the worker group (an attempt starts with rank
0's ``layout`` line, then ``resumed from ... at step R`` when a checkpoint exists) draws a target step
uniformly from R+1 .. R+2*every, waits until rank 0 logs it, and sends SIGKILL to one of the
launcher's worker processes, drawn at random. The kill lands wherever that worker is at that moment
(mid-step, mid-collective, mid-save), like a machine failure; the launcher restarts the group, which
resumes from the newest complete checkpoint. After ``--kills`` kills the run is left to finish, and
its final checkpoint is compared with an uninterrupted run's, tensor by tensor, with torch.equal.

Prints per kill: the rank killed, the step at the kill (the last step rank 0 logged in that attempt)
and the step resumed from, their difference being the steps redone; then runs, kills, failures (runs
that did not finish, or whose weights differ) and the steps redone in all. Not part of the test
suite; results belong in docs/benchmarks.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/chaos.py --kills 20 --seed 0
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from paratrain.checkpoint.tensor_reader import TensorReader

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_GPT = {
    "factory": "paratrain.models.gpt:build_gpt",
    "args": {"block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32},
}
TINY_TEXT = {"factory": "paratrain.data.text:build_char_dataset", "args": {"block_size": 16, "max_chars": 40_000}}
ATTEMPT_STARTED = re.compile(r"paratrain: layout ")
RESUMED = re.compile(r"resumed from \S+ at step (\d+)")
STEP_LOGGED = re.compile(r"paratrain: step (\d+)/\d+")


def write_config(directory: Path, name: str, *, steps: int, every: int, strategy: str, pp: int | None) -> Path:
    config = {
        "run": {"name": name, "output_dir": str(directory / name)},
        "train": {"max_steps": steps, "global_batch_size": 8, "micro_batch_size": 2, "seed": 0},
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "parallel": {"strategy": strategy, "pp": pp},
        "log": {"every_steps": 1, "progress_bar": "off"},
        "checkpoint": {"every_steps": every, "keep_last": 2},
        "model": TINY_GPT,
        "data": TINY_TEXT,
    }
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def cli(config: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "paratrain.cli", "train", str(config), *args]


def final_weights(output_dir: Path, step: int) -> dict[str, torch.Tensor]:
    checkpoint = output_dir / "checkpoints" / f"step-{step}"
    with TensorReader(checkpoint, verify=False) as reader:
        return {key.removeprefix("model."): tensor for key, tensor in reader.read(reader.tensors("model."))}


@dataclass
class Attempt:
    """One start of the worker group, as rank 0's log lines tell it."""

    resumed: int = 0  # the step it resumed from (0: started from scratch)
    last_step: int | None = None  # the last step it logged


@dataclass
class Kill:
    rank: int
    attempt: Attempt
    resumed_next: int | None = None  # the step the next attempt resumed from

    @property
    def redone(self) -> int | None:
        if self.resumed_next is None or self.attempt.last_step is None:
            return None
        return self.attempt.last_step - self.resumed_next


@dataclass
class LauncherLog:
    """Follows the launcher's stderr in a thread; the killer waits on it."""

    process: subprocess.Popen
    attempts: list[Attempt] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def follow(self) -> None:
        for line in self.process.stderr:
            with self.changed:
                self.lines.append(line)
                self._read(line)
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def _read(self, line: str) -> None:
        if ATTEMPT_STARTED.search(line):
            self.attempts.append(Attempt())
        elif (resumed := RESUMED.search(line)) and self.attempts:
            self.attempts[-1].resumed = int(resumed.group(1))
        elif (step := STEP_LOGGED.search(line)) and self.attempts:
            self.attempts[-1].last_step = int(step.group(1))

    def wait_until(self, condition, timeout: float = 600) -> bool:
        """Waits until condition() holds (True) or the launcher has exited (False)."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not condition():
                if self.process.poll() is not None or time.monotonic() > deadline:
                    return False
                self.changed.wait(timeout=0.2)
        return True


def worker_pids(launcher: int) -> list[int]:
    """The launcher's children: torchrun's workers."""
    tasks = Path(f"/proc/{launcher}/task")
    return sorted(int(child) for task in tasks.iterdir() for child in (task / "children").read_text().split())


def rank_of(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(item for item in environ if item.startswith(b"RANK=")).split(b"=", 1)[1])


def run_with_kills(
    config: Path, *, nproc: int, kills: int, every: int, steps: int, seed: int
) -> tuple[int, list[Kill], LauncherLog]:
    """Trains under the killer; returns the launcher's exit code, the kills and the log."""
    rng = random.Random(seed)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        cli(config, "--nproc-per-node", str(nproc), "--max-restarts", str(kills + 5)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO_ROOT,
    )
    log = LauncherLog(process)
    threading.Thread(target=log.follow, daemon=True).start()
    done: list[Kill] = []
    for number in range(1, kills + 1):
        kill = kill_once(log, rng, attempt_number=number, every=every, steps=steps)
        if kill is None:
            break
        done.append(kill)
    process.wait(timeout=1800)
    time.sleep(0.5)  # the reader thread drains the last lines
    for index, kill in enumerate(done):
        if index + 1 < len(log.attempts):
            kill.resumed_next = log.attempts[index + 1].resumed
    return process.returncode, done, log


def kill_once(log: LauncherLog, rng: random.Random, *, attempt_number: int, every: int, steps: int) -> Kill | None:
    """Waits for attempt ``attempt_number`` to reach a random step, then SIGKILLs a random worker;
    None when the run ended first."""
    # Once the attempt has logged a step, where it resumed from is known.
    if not log.wait_until(lambda: len(log.attempts) == attempt_number and log.attempts[-1].last_step is not None):
        return None
    attempt = log.attempts[-1]
    target = min(attempt.resumed + rng.randint(1, 2 * every), steps - every)
    if not log.wait_until(lambda: attempt.last_step >= target):
        return None
    pid = rng.choice(worker_pids(log.process.pid))
    rank = rank_of(pid)
    os.kill(pid, signal.SIGKILL)
    return Kill(rank, attempt)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs per run")
    parser.add_argument("--runs", type=int, default=1, help="runs under the killer (seeds seed, seed+1, ...)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the killer's choices (step and rank)")
    parser.add_argument("--every", type=int, default=10, help="checkpoint.every_steps")
    parser.add_argument("--steps", type=int, help="train.max_steps (default: (kills + 3) x every)")
    parser.add_argument("--strategy", default="ddp", help="parallel.strategy (ddp, fsdp, ...)")
    parser.add_argument("--nproc", type=int, default=2, help="processes")
    parser.add_argument("--pp", type=int, help="parallel.pp: pipeline stages beside --strategy (e.g. fsdp x pp)")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # progress shows as it comes, also into a file
    steps = args.steps or (args.kills + 3) * args.every

    with tempfile.TemporaryDirectory(prefix="paratrain-chaos-") as scratch:
        directory = Path(scratch)
        started = time.monotonic()
        reference = write_config(
            directory, "uninterrupted", steps=steps, every=args.every, strategy=args.strategy, pp=args.pp
        )
        subprocess.run(
            cli(reference, "--nproc-per-node", str(args.nproc)),
            check=True,
            capture_output=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            cwd=REPO_ROOT,
        )
        expected = final_weights(directory / "uninterrupted", steps)
        print(
            f"{args.strategy} x {args.nproc}{f' (pp {args.pp})' if args.pp else ''}, tiny GPT, {steps} steps, checkpoint every {args.every}; "
            f"torch {torch.__version__}; uninterrupted run {time.monotonic() - started:.0f} s"
        )
        total_kills, failures, redone = 0, 0, 0
        for run in range(args.runs):
            seed = args.seed + run
            config = write_config(
                directory, f"chaos-{seed}", steps=steps, every=args.every, strategy=args.strategy, pp=args.pp
            )
            started = time.monotonic()
            code, kills, log = run_with_kills(
                config, nproc=args.nproc, kills=args.kills, every=args.every, steps=steps, seed=seed
            )
            print(
                f"\nrun {run + 1} (seed {seed}): exit code {code}, {len(log.attempts)} attempts, "
                f"{time.monotonic() - started:.0f} s"
            )
            print("| kill | rank | step at kill | resumed from | steps redone |\n|---|---|---|---|---|")
            for number, kill in enumerate(kills, 1):
                print(f"| {number} | {kill.rank} | {kill.attempt.last_step} | {kill.resumed_next} | {kill.redone} |")
            matches = code == 0 and _same(final_weights(directory / f"chaos-{seed}", steps), expected)
            if code != 0:
                print("".join(log.lines[-30:]), end="")
            print(f"final weights torch.equal to the uninterrupted run's: {matches}")
            total_kills += len(kills)
            failures += not matches
            redone += sum(kill.redone or 0 for kill in kills)
        print(
            f"\nruns: {args.runs}, kills: {total_kills}, failures: {failures}, steps redone: {redone} "
            f"(checkpoint every {args.every} steps)"
        )
    return 1 if failures else 0


def _same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return actual.keys() == expected.keys() and all(torch.equal(actual[name], expected[name]) for name in expected)


if __name__ == "__main__":
    sys.exit(main())
