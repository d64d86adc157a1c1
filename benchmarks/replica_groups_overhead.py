"""What fault-tolerant replica groups cost when nothing fails: hsdp against replica groups, side by side.

The same tiny GPT, global batch and ``--groups x --procs`` processes, trained ``--steps`` steps without a
kill, first as one hsdp job (dp_replicate=groups x dp_shard=procs), then as ``--groups`` replica groups of
fsdp x procs joined through a loopback `paratrain lighthouse` at its defaults; the order alternates between
rounds (``--rounds``) so that a drift of the machine's speed favours neither. Prints, per round and as the
median over rounds, each layout's steady step time (the mean step after ``--warmup`` steps, from the logged
step times: start-up and the first quorum are left out) and its whole wall time, and the ratios groups /
hsdp. Not part of the suite; results belong in docs/benchmarks.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/replica_groups_overhead.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.chaos_replica_groups import cli, records, start_lighthouse  # noqa: E402 - the sibling benchmark, after the path
from tests.harness import tiny_config  # noqa: E402 - the repository's own harness, after its path


def train_jobs(kind: str, config: Path, *, groups: int, procs: int) -> list[list[str]]:
    """The `paratrain` command lines of one layout: one hsdp job, or one job per replica group."""
    if kind == "hsdp":
        return [
            [
                "train", str(config), "--nproc-per-node", str(groups * procs),
                f"parallel.dp_shard={procs}", f"parallel.dp_replicate={groups}",
            ]
        ]  # fmt: skip
    return [
        [
            "train", str(config), "--nproc-per-node", str(procs), f"parallel.dp_shard={procs}",
            "--replica-group", str(group), "--replica-groups", str(groups),
        ]
        for group in range(groups)
    ]  # fmt: skip


def steady_step_s(output_dir: Path, *, warmup: int) -> float:
    """The mean time between logged steps after the first ``warmup`` (the step time once started)."""
    rows = records(output_dir)
    first, last = rows[warmup - 1], rows[-1]
    return (last["time"] - first["time"]) / (last["step"] - first["step"])


def run_layout(kind: str, work: Path, *, args: argparse.Namespace, lighthouse: str, round_: int) -> tuple[float, float]:
    """Trains one layout to the end; (steady step time in s, wall time in s)."""
    out = work / f"{kind.replace(' ', '-')}-{round_}"
    train = {"max_steps": args.steps, "global_batch_size": 4 * args.groups * args.procs, "micro_batch_size": 4}
    config = tiny_config(out, train={**train, "seed": 0}, checkpoint={"every_steps": args.steps})
    config["parallel"] = {"fault_tolerance": {"lighthouse": lighthouse}}
    path = work / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    started = time.monotonic()
    commands = train_jobs(kind, path, groups=args.groups, procs=args.procs)
    jobs = [cli(command, work / f"{out.name}-job-{index}.log") for index, command in enumerate(commands)]
    codes = [job.wait() for job in jobs]
    wall = time.monotonic() - started
    if any(codes):
        raise SystemExit(f"{kind}, round {round_}: exit codes {codes}; see {work}")
    logged = out if kind == "hsdp" else out / "replica-group-0"
    return steady_step_s(logged, warmup=args.warmup), wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of the steady step time")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ft-overhead-"))
    lighthouse_process, lighthouse = start_lighthouse(work)
    step_ratios, wall_ratios = [], []
    print(f"{args.groups} x {args.procs} processes, {args.steps} steps, steady after {args.warmup} ({work})")
    print("| round | hsdp: step, wall | replica groups: step, wall | step, groups / hsdp | wall, groups / hsdp |")
    print("|---|---|---|---|---|")
    try:
        for round_ in range(args.rounds):
            order = ["hsdp", "replica groups"] if round_ % 2 == 0 else ["replica groups", "hsdp"]
            measured = {kind: run_layout(kind, work, args=args, lighthouse=lighthouse, round_=round_) for kind in order}
            (hsdp_step, hsdp_wall), (groups_step, groups_wall) = measured["hsdp"], measured["replica groups"]
            step_ratios.append(groups_step / hsdp_step)
            wall_ratios.append(groups_wall / hsdp_wall)
            print(
                f"| {round_} | {hsdp_step * 1000:.1f} ms, {hsdp_wall:.1f} s | {groups_step * 1000:.1f} ms, "
                f"{groups_wall:.1f} s | {step_ratios[-1]:.3f} | {wall_ratios[-1]:.3f} |",
                flush=True,
            )
    finally:
        lighthouse_process.terminate()
        lighthouse_process.communicate()
    print(
        f"\nmedian over {args.rounds} rounds: step {statistics.median(step_ratios):.3f} x hsdp "
        f"(spread {min(step_ratios):.3f}-{max(step_ratios):.3f}), wall {statistics.median(wall_ratios):.3f} x "
        f"(spread {min(wall_ratios):.3f}-{max(wall_ratios):.3f})"
    )


if __name__ == "__main__":
    main()
