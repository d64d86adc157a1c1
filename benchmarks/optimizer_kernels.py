"""torch's fused AdamW against foreach AdamW on the CPU (``optim.fused: on`` / ``off``), side by side.

The quickstart's tiny GPT, trained ``--steps`` steps as one process (plain tensors) and as fsdp x 2 (DTensors),
with each kernel; the order of the two alternates between rounds (``--rounds``) so that a drift of the machine's
speed favours neither. Prints, per round and as the median over rounds, each kernel's steady step time (the median
logged ``step_time_s`` after ``--warmup`` steps) and its first step's (a fresh process's: fsdp's first step works out
DTensor's sharding of every distinct op once, which a restarted replica group's live peers wait for), and the
ratios fused / foreach. Not part of the suite; results belong in docs/benchmarks.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/optimizer_kernels.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.harness import read_metrics, tiny_config, write_config  # noqa: E402 - after the path above

LAYOUTS = {"one process": (1, []), "fsdp x 2": (2, ["parallel.dp_shard=2"])}
KERNELS = {"foreach": "off", "fused": "on"}


def train(work: Path, name: str, *, nproc: int, overrides: list[str], fused: str, steps: int) -> list[float]:
    """Each logged step's ``step_time_s`` of one `paratrain train` run."""
    out = work / name
    train_section = {"max_steps": steps, "global_batch_size": 8, "micro_batch_size": 4}
    config = write_config(work / f"{name}.yaml", tiny_config(out, train=train_section, optim={"fused": fused}))
    command = [sys.executable, "-m", "paratrain.cli", "train", str(config), "--nproc-per-node", str(nproc)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*command, *overrides], env=env, cwd=REPO, check=True, capture_output=True)
    return [row["step_time_s"] for row in read_metrics(out)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="optimizer-kernels-"))
    print(f"{args.steps} steps, steady after {args.warmup} ({work})")
    print(
        "| layout | round | foreach: step, first step | fused: step, first step | step, fused / foreach | first step |"
    )
    print("|---|---|---|---|---|---|")
    for layout, (nproc, overrides) in LAYOUTS.items():
        ratios: dict[str, list[float]] = {"step": [], "first": []}
        for round_index in range(args.rounds):
            order = list(KERNELS) if round_index % 2 == 0 else list(reversed(KERNELS))
            times = {}
            for kernel in order:
                name = f"{layout.replace(' ', '')}-{kernel}-{round_index}"
                logged = train(work, name, nproc=nproc, overrides=overrides, fused=KERNELS[kernel], steps=args.steps)
                times[kernel] = (statistics.median(logged[args.warmup :]), logged[0])
            (step_a, first_a), (step_b, first_b) = times["foreach"], times["fused"]
            ratios["step"].append(step_b / step_a)
            ratios["first"].append(first_b / first_a)
            print(
                f"| {layout} | {round_index} | {step_a * 1000:.2f} ms, {first_a * 1000:.0f} ms "
                f"| {step_b * 1000:.2f} ms, {first_b * 1000:.0f} ms "
                f"| {step_b / step_a:.3f} | {first_b / first_a:.3f} |",
                flush=True,
            )
        print(
            f"| {layout} | median | | | {statistics.median(ratios['step']):.3f} "
            f"({min(ratios['step']):.3f}-{max(ratios['step']):.3f}) | {statistics.median(ratios['first']):.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
