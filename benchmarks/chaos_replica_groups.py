"""Chaos on fault-tolerant replica groups against today's restart-all, on one kill schedule.

Replica groups: a loopback `paratrain lighthouse` and ``--groups`` groups of ``--procs`` processes (fsdp
inside each), each its own `paratrain train --replica-group I --replica-groups N --max-restarts K`. Restart-
all: one `paratrain train` of the same ``groups x procs`` processes as hsdp (dp_replicate=groups x
dp_shard=procs), checkpointing every ``--every`` steps and resuming from the newest checkpoint after each
restart. Both train the same tiny GPT for ``--steps`` steps, every step logged, and each is run once
without kills (its baseline wall time) and once with ``--kills`` kills: when the run's newest logged step
reaches the next step of the schedule (every ``--gap`` steps from ``--first``), SIGKILL one worker of a
random group (replica groups) or of the job (restart-all); the kill at ``--double`` hits two groups at once.
Restart-all also loses the steps since its newest checkpoint, as many as the kill's offset in ``--every``: a
``--gap`` that is not a multiple of ``--every`` spreads the offsets (``--gap 53``: 1-23 steps of 25, mean 11, where
a kill at a random time loses 12), where ``--gap 50`` put every kill at the same one (5 steps from ``--first 30``,
20 from ``--first 20`` before, and the ratio of the two layouts' losses moved with the offset).

Prints, per layout: wall time without and with kills, wall time lost per kill, the time the run stood still
per kill (``time_paused``: steadier than the wall times), also beyond the run without kills' (its saves), steps
recomputed (a step
logged again by the same group), the longest pause between two consecutive steps of a group, and whether
every run finished (exit 0); also the largest relative difference, over every step, between
the loss the run with kills logged last for a step and the run without kills' (under ``--batch fixed``, the
default, a failure changes only the time: ~1e-6), and the samples skipped. Not part of the suite; results belong in docs/benchmarks.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/chaos_replica_groups.py --groups 3 --procs 2 --kills 10 --gap 53
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.harness import free_loopback_port, tiny_config, worker_pids  # noqa: E402 - the repository's own harness, after its path

KINDS = ["replica groups", "restart-all"]


def cli(args: list[str], log: Path) -> subprocess.Popen:
    """``paratrain ARGS``, its output to ``log`` (a pipe nobody reads would fill and stall it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as stream:
        return subprocess.Popen(
            [sys.executable, "-m", "paratrain.cli", *args], env=env, cwd=REPO, stdout=stream, stderr=subprocess.STDOUT
        )


def start_lighthouse(work: Path) -> tuple[subprocess.Popen, str]:
    """A `paratrain lighthouse` on a free loopback port, at its defaults as a user starts it (a restarted group is
    let in as soon as it asks, whatever the heartbeat timeout: it registers under the dead one's id); the process
    and the address the groups' config names."""
    port = free_loopback_port()
    lighthouse = cli(["lighthouse", "--bind", f"127.0.0.1:{port}"], work / "lighthouse.log")
    time.sleep(3)
    return lighthouse, f"http://127.0.0.1:{port}"


def records(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def newest_step(dirs: list[Path]) -> int:
    """The newest step any of ``dirs`` logged, from the end of each log alone: polled every 50 ms while the run
    trains, reading whole logs (up to 2k lines a poll) took CPU from the run with kills alone, slowing each of its
    steps by 10-25 ms on two cores against the run without."""
    return max((step for step in map(last_logged_step, dirs) if step is not None), default=0)


def last_logged_step(output_dir: Path) -> int | None:
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    with path.open("rb") as stream:
        stream.seek(max(0, path.stat().st_size - 4096))
        lines = [line for line in stream.read().decode(errors="replace").splitlines() if line.strip().endswith("}")]
    for line in reversed(lines):
        with contextlib.suppress(json.JSONDecodeError, KeyError):  # the first line read may be cut
            return json.loads(line)["step"]
    return None


def run(jobs: list[list[str]], dirs: list[Path], schedule: list[tuple[int, int]], seed: int) -> tuple[float, list[int]]:
    """Starts the jobs, kills on the schedule ((step, how many jobs at once)), waits; (wall s, exit codes)."""
    rng, started = random.Random(seed), time.monotonic()
    processes = [cli(job, dirs[0].parent / f"job-{index}.log") for index, job in enumerate(jobs)]
    pending = list(schedule)
    while any(process.poll() is None for process in processes):
        if pending and newest_step(dirs) >= pending[0][0]:
            _, count = pending.pop(0)
            targets = rng.sample(range(len(processes)), min(count, len(processes)))
            for index in targets if len(processes) > 1 else [0] * count:
                workers = worker_pids(processes[index].pid)
                if workers:
                    os.kill(rng.choice(workers), signal.SIGKILL)
            print(f"  kill at step {newest_step(dirs)} ({time.time():.2f}): job(s) {targets}", flush=True)
        time.sleep(0.05)
    for process in processes:
        process.communicate()
    return time.monotonic() - started, [process.returncode for process in processes]


# A step that took this many times the run's median step was a pause (a kill's), not an ordinary step.
PAUSE_FACTOR = 4


def measures(dirs: list[Path]) -> tuple[int, float]:
    """(steps logged again by the same group, longest pause in s between consecutive steps of a group)."""
    again, pause = 0, 0.0
    for rows in map(records, dirs):
        seen: set[int] = set()
        for before, after in zip(rows, rows[1:]):
            if after["step"] == before["step"] + 1:
                pause = max(pause, after["time"] - before["time"])
        for row in rows:
            again += row["step"] in seen
            seen.add(row["step"])
    return again, pause


def time_paused(dirs: list[Path]) -> float:
    """Seconds the run stood still: over the steps that took more than PAUSE_FACTOR times the run's median step
    (a step's time: when its last group logged it, a retaken step's last logging), what each took beyond that
    median. It leaves out a drift of every ordinary step's time between two runs, which wall times keep (5-10 ms a
    step between the two runs of a pair on 2 cores: up to 0.6 s a kill over 620 steps). Restart-all's pause holds
    the steps it lost (taken since its checkpoint, before the kill: their redone loggings replace them) and its
    restart, not the redoing (counted apart: steps logged again). A run also stands still without kills: each
    checkpoint save (every ``--every`` steps) took 0.2-0.3 s, over PAUSE_FACTOR median steps where a step took
    60 ms; so what the kills cost is the pause beyond the same run's without kills (both printed)."""
    logged: dict[int, float] = {}
    for rows in map(records, dirs):
        for row in rows:
            logged[row["step"]] = max(logged.get(row["step"], 0.0), row["time"])
    times = [logged[step] for step in sorted(logged)]
    steps = [after - before for before, after in zip(times, times[1:])]
    median = statistics.median(steps)
    return sum(step - median for step in steps if step > PAUSE_FACTOR * median)


def loss_trace(dirs: list[Path]) -> dict[int, float]:
    """Each step's loss as group 0 (or the job) logged it last: a step retaken after a kill replaces the first."""
    return {row["step"]: row["loss"] for row in records(dirs[0])}


def trace_difference(killed: dict[int, float], base: dict[int, float]) -> float:
    return max(abs(killed[step] - base[step]) / abs(base[step]) for step in base.keys() & killed.keys())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--kills", type=int, default=10)
    # The first kill after the first checkpoint (--every): restart-all, killed before it, started again from step 0,
    # and its pause fell before any logged step, where time_paused cannot see it (one kill of ten went uncounted).
    parser.add_argument("--first", type=int, default=30)
    parser.add_argument("--gap", type=int, default=25)
    parser.add_argument("--every", type=int, default=25, help="checkpoint every (both layouts)")
    parser.add_argument("--double", type=int, default=5, help="which kill (0-based) hits two groups at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", default="fixed", choices=["fixed", "shrink"], help="parallel.fault_tolerance.batch")
    parser.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS, help="which layouts to run (default both)")
    args = parser.parse_args()
    steps = args.first + args.gap * args.kills + 2 * args.gap  # no kill near the end: a group must find a peer
    schedule = [(args.first + args.gap * k, 2 if k == args.double else 1) for k in range(args.kills)]
    work = Path(tempfile.mkdtemp(prefix="chaos-ft-"))
    lighthouse, address = start_lighthouse(work)
    groups, procs = args.groups, args.procs
    train = {"max_steps": steps, "global_batch_size": 4 * groups * procs, "micro_batch_size": 4, "seed": 0}
    results = {}
    for kind in args.kinds:
        for kills in (False, True):
            out = work / f"{kind.replace(' ', '-')}-{'kills' if kills else 'base'}"
            config = tiny_config(out, train=train, checkpoint={"every_steps": args.every, "keep_last": 2})
            fault_tolerance = {"lighthouse": address, "timeout_s": 5, "batch": args.batch}
            config["parallel"] = {"fault_tolerance": fault_tolerance}
            path = work / f"{out.name}.yaml"
            path.write_text(yaml.safe_dump(config))
            common = ["train", str(path), "--nproc-per-node", str(procs), "--max-restarts", str(2 * args.kills)]
            if kind == "replica groups":
                jobs = [
                    [*common, f"parallel.dp_shard={procs}", "--replica-group", str(g), "--replica-groups", str(groups)]
                    for g in range(groups)
                ]
                dirs = [out / f"replica-group-{g}" for g in range(groups)]
            else:
                jobs = [
                    [
                        "train",
                        str(path),
                        "--nproc-per-node",
                        str(groups * procs),
                        "--max-restarts",
                        str(2 * args.kills),
                        f"parallel.dp_shard={procs}",
                        f"parallel.dp_replicate={groups}",
                    ]
                ]
                dirs = [out]
            print(f"{kind}, {'kills' if kills else 'no kills'} ({out}):", flush=True)
            out.mkdir(parents=True, exist_ok=True)
            wall, codes = run(jobs, dirs, schedule if kills else [], args.seed)
            again, pause = measures(dirs)
            skipped = max((row.get("skipped_samples", 0) for d in dirs for row in records(d)), default=0)
            results[kind, kills] = (wall, codes, again, pause, loss_trace(dirs), skipped, time_paused(dirs))
            print(
                f"  wall {wall:.1f} s, exit codes {codes}, steps logged again {again}, longest pause {pause:.1f} s",
                flush=True,
            )
    lighthouse.terminate()
    lighthouse.communicate()
    print(
        f"\n{steps} steps, {args.kills} kills, checkpoint every {args.every}, {groups} x {procs} processes, batch {args.batch}"
    )
    print(
        "| layout | wall, no kills | wall, kills | lost per kill | paused per kill (beyond no kills') "
        "| steps logged again | longest pause "
        "| all exit 0 | loss vs no kills, max rel | samples skipped |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kind in args.kinds:
        base, killed = results[kind, False], results[kind, True]
        lost = (killed[0] - base[0]) / args.kills
        ok = all(code == 0 for code in base[1] + killed[1])
        trace = f"{trace_difference(killed[4], base[4]):.1e}"
        paused, beyond = killed[6] / args.kills, (killed[6] - base[6]) / args.kills
        print(
            f"| {kind} | {base[0]:.1f} s | {killed[0]:.1f} s | {lost:.2f} s | {paused:.2f} s ({beyond:.2f} s) | {killed[2]} "
            f"| {killed[3]:.1f} s | {ok} "
            f"| {trace} | {killed[5]} |"
        )


if __name__ == "__main__":
    main()
