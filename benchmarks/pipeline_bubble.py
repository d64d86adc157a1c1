"""Pipeline bubble and activation memory of torch's schedules under paratrain, measured on CPU.

Each case trains a model of identical blocks (``uniform_stages.py``: every stage costs the same) with
``paratrain train`` on 2 processes, pipeline.record_timeline on. The measured bubble is the idle
share of both ranks' time per step, from the recorded start and end of every forward and backward
(the first step, which infers shapes, is skipped); theory is the same quantity from the schedule's
action table with uniform stages and free communication (``paratrain.parallel.pipeline.timeline``). Peak
activation memory is the most bytes saved for backward alive at once on a rank
(``saved_tensors_hooks``). Threads are pinned to one per process so the two ranks do not contend.

Targets: GPipe and 1F1B within +-0.05 of theory at p=2, m in {2, 4, 8}; interleaved and
zero-bubble below 1F1B; 1F1B's peak activations per rank below GPipe's at m=8. It prints, it never
asserts; results go in docs/benchmarks.md.

    .venv/bin/python benchmarks/pipeline_bubble.py --figure docs/images/pipeline-1f1b-m4-measured.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from paratrain.parallel.pipeline.recorder import measured_bubble, read_timelines  # noqa: E402
from paratrain.parallel.pipeline.schedules import PipelineShape, default_stages_per_rank  # noqa: E402
from paratrain.parallel.pipeline.timeline import simulate  # noqa: E402

CASES = [
    ("GPipe", 2),
    ("GPipe", 4),
    ("GPipe", 8),
    ("1F1B", 2),
    ("1F1B", 4),
    ("1F1B", 8),
    ("Interleaved1F1B", 8),
    ("InterleavedZeroBubble", 8),
    ("ZBVZeroBubble", 8),
]


def run_case(schedule: str, microbatches: int, args: argparse.Namespace, root: Path, attempt: int) -> dict:
    name = f"{schedule}-m{microbatches}-{attempt}"
    output_dir, activations = root / name, root / f"{name}-activations"
    activations.mkdir(parents=True)
    config = {
        "run": {"name": name, "output_dir": str(output_dir)},
        "train": {
            "max_steps": args.steps,
            "global_batch_size": microbatches * args.micro_batch,
            "micro_batch_size": args.micro_batch,
            "seed": 0,
            "grad_clip": None,
        },
        "optim": {"name": "sgd", "lr": 1e-3},
        "parallel": {"strategy": "pp"},
        "pipeline": {"schedule": schedule},
        "checkpoint": {"every_steps": 0, "save_final": False},
        "log": {"every_steps": args.steps},
        "model": {
            "factory": "benchmarks.uniform_stages:build_model",
            "args": {"width": args.width, "depth": args.depth, "delay_ms": args.delay_ms},
        },
        "data": {"factory": "benchmarks.uniform_stages:build_data", "args": {"width": args.width}},
        "loss": {"factory": "paratrain.losses:mse"},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PARATRAIN_BENCH_ACTIVATIONS": str(activations)}
    result = subprocess.run(
        [sys.executable, "-m", "paratrain.cli", "train", str(path), "--nproc-per-node", "2"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if result.returncode:
        raise SystemExit(f"{name} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    shape = PipelineShape(schedule, 2, default_stages_per_rank(schedule), microbatches)
    peaks = [json.loads(p.read_text()) for p in activations.glob("*.json")]
    return {
        "schedule": schedule,
        "m": microbatches,
        "v": shape.stages_per_rank,
        "theory": float(simulate(shape).idle_fraction()),
        "measured": measured_bubble(read_timelines(output_dir / "pipeline"), skip_first=args.skip),
        "peak_activation_mib": [round(p["peak_bytes"] / 2**20, 2) for p in sorted(peaks, key=lambda p: p["rank"])],
        "run_dir": str(output_dir),
    }


def median_case(runs: list[dict]) -> dict:
    """The run with the median measured bubble, with the spread of all runs of the case."""
    ordered = sorted(runs, key=lambda r: r["measured"])
    return {**ordered[len(ordered) // 2], "spread": (ordered[0]["measured"], ordered[-1]["measured"])}


def print_table(results: list[dict]) -> None:
    print(
        f"{'schedule':<22} {'v':>2} {'m':>2} {'theory':>7} {'measured':>9} {'diff':>7} {'min..max':>13}  "
        f"peak activations per rank (MiB)"
    )
    for r in results:
        diff = r["measured"] - r["theory"]
        low, high = r["spread"]
        print(
            f"{r['schedule']:<22} {r['v']:>2} {r['m']:>2} {r['theory']:>7.3f} {r['measured']:>9.3f} {diff:>+7.3f} "
            f"{low:>6.3f}..{high:<6.3f}  {r['peak_activation_mib']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--compute",
        choices=("sleep", "matmul"),
        default="sleep",
        help="sleep: each block sleeps --delay-ms per forward, input-gradient and weight-gradient "
        "(exactly uniform, no CPU contention); matmul: real Linear(width) compute only",
    )
    parser.add_argument("--delay-ms", type=float, default=2.5, help="per block and pass, with --compute sleep")
    parser.add_argument("--width", type=int, help="block width (default 64 with sleep, 1024 with matmul)")
    parser.add_argument("--depth", type=int, default=8, help="identical blocks (divisible by 4 for v=2)")
    parser.add_argument("--micro-batch", type=int, default=64, help="samples per micro-batch")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="recorded steps to skip as warm-up")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; the median is reported")
    parser.add_argument("--figure", type=Path, help="also draw the 1F1B m=4 run's measured timeline here")
    args = parser.parse_args()
    args.width = args.width or (64 if args.compute == "sleep" else 1024)
    if args.compute == "matmul":
        args.delay_ms = 0.0
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    compute = f"sleeping {args.delay_ms} ms per block and pass" if args.delay_ms else "real matmuls only"
    print(
        f"model: {args.depth} blocks of Linear({args.width}, {args.width}) + tanh, {compute}, micro-batch "
        f"{args.micro_batch}, {args.steps} steps per run, first {args.skip} skipped, median of {args.repeats} runs, "
        f"p=2 on 2 processes x 1 thread"
    )
    with tempfile.TemporaryDirectory(prefix="pipeline-bubble-") as tmp:
        # Cases alternate within each round, so a burst of load on the shared machine hits all alike.
        rounds = [
            [run_case(schedule, m, args, Path(tmp), attempt) for schedule, m in CASES]
            for attempt in range(args.repeats)
        ]
        results = [median_case([round_[index] for round_ in rounds]) for index in range(len(CASES))]
        print_table(results)
        if args.figure:
            draw_measured(next(r for r in results if r["schedule"] == "1F1B" and r["m"] == 4), args.figure)


def draw_measured(result: dict, figure: Path) -> None:
    from paratrain.tools.pipeline_show import draw, measured_bars

    timelines = read_timelines(Path(result["run_dir"]) / "pipeline")
    draw(
        measured_bars(timelines),
        figure,
        title=f"1F1B, p=2, m=4, measured on CPU: bubble {result['measured']:.3f} (theory {result['theory']:.3f})",
    )
    print(f"measured timeline drawn to {figure}")


if __name__ == "__main__":
    main()
