"""What monitoring costs: step time with the memory and throughput monitors, inside a profiler window,
and the time of an evaluation pass, against the same run without them.

One process, the built-in GPT on its character data, every step logged (the monitors' worst case:
they work on log steps only). Each round trains every variant once, in an order that rotates from round
to round, on a machine shared with others; the medians over all rounds are printed.

- *plain*: no callbacks, no evaluation, no profiler.
- *monitors*: MemoryMonitor + ThroughputMonitor; also prints the achieved FLOP/s they log, and the
  monitors' own cost per log step, timed directly (their on_step_end called 200 times after training).
- *profiler*: profile.enabled; step time inside the active window against plain's same steps.
- *eval*: eval every ``--eval-every`` steps on ``--eval-samples`` samples: the time of one evaluation
  pass (``eval_time_s``), and the step time, from which the trainer leaves the pass out.

This prints, it never asserts; results belong in docs/benchmarks.md.

    .venv/bin/python benchmarks/callbacks_overhead.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import paratrain

MONITORS = (
    "callbacks=[{factory: 'paratrain.callbacks.memory:MemoryMonitor'}, "
    "{factory: 'paratrain.callbacks.throughput:ThroughputMonitor'}]"
)
PROFILE = {"wait": 10, "warmup": 2, "active": 10}


def variants(eval_every: int, eval_samples: int) -> dict[str, list[str]]:
    window = [f"profile.{key}={value}" for key, value in PROFILE.items()]
    return {
        "plain": [],
        "monitors": [MONITORS],
        "profiler": ["profile.enabled=true", *window],
        "eval": [
            "eval.factory=paratrain.data.text:build_char_dataset",
            f"eval.every_steps={eval_every}",
            f"eval.args={{block_size: 64, max_chars: {eval_samples * 64 + 1}}}",
            "eval.batch_size=8",
        ],
    }


def train(overrides: list[str], *, steps: int, output_dir: Path, hook_times: list[float]) -> list[dict]:
    config = paratrain.load_config(
        None,
        [
            f"run.output_dir={output_dir}",
            "checkpoint.resume=never",
            "checkpoint.save_final=false",
            f"train.max_steps={steps}",
            "train.global_batch_size=8",
            "train.micro_batch_size=8",
            "log.every_steps=1",
            "model.args={block_size: 64, n_layer: 4, n_head: 4, n_embd: 128}",
            "data.args={block_size: 64, max_chars: 200000}",
            *overrides,
        ],
    )
    trainer = paratrain.Trainer(config)
    try:
        trainer.train()
        if config.callbacks:
            hook_times.append(time_step_end_hooks(trainer))
    finally:
        trainer.close()
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def time_step_end_hooks(trainer, calls: int = 200) -> float:
    """Seconds the callbacks' on_step_end takes on a log step."""
    started = time.perf_counter()
    for _ in range(calls):
        trainer.callbacks.call("on_step_end", record={"samples_per_s": 1.0})
    return (time.perf_counter() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-samples", type=int, default=64)
    args = parser.parse_args()
    runs = variants(args.eval_every, args.eval_samples)
    steps: dict[str, list[float]] = {name: [] for name in runs}
    eval_passes: list[float] = []
    hook_times: list[float] = []
    window = range(PROFILE["wait"] + PROFILE["warmup"] + 1, PROFILE["wait"] + PROFILE["warmup"] + 1 + PROFILE["active"])
    plain_in_window: list[float] = []
    flops: list[float] = []
    with tempfile.TemporaryDirectory() as root:
        for round_index in range(args.rounds):
            names = list(runs)
            names = names[round_index % len(names) :] + names[: round_index % len(names)]
            for name in names:
                records = train(
                    runs[name], steps=args.steps, output_dir=Path(root) / f"{name}-{round_index}", hook_times=hook_times
                )
                eval_passes += [r["eval_time_s"] for r in records if "eval_time_s" in r]
                if name == "plain":
                    plain_in_window += [r["step_time_s"] for r in records if r["step"] in window]
                if name == "profiler":  # only the steps inside the active window
                    records = [r for r in records if r["step"] in window]
                else:
                    records = records[5:]  # past the first steps' one-time costs
                steps[name] += [r["step_time_s"] for r in records]
                flops += [r["flops_per_s"] for r in records if "flops_per_s" in r]
    print(f"{'variant':<10} {'median step ms':>15} {'vs plain':>9}")
    for name, times in steps.items():
        plain = statistics.median(plain_in_window if name == "profiler" else steps["plain"])
        print(f"{name:<10} {statistics.median(times) * 1e3:>15.2f} {statistics.median(times) / plain:>9.3f}")
    print(
        f"memory + throughput monitors, on_step_end of a log step: median {statistics.median(hook_times) * 1e3:.3f} ms"
    )
    print(
        f"one evaluation pass ({args.eval_samples} samples in batches of 8): median "
        f"{statistics.median(eval_passes) * 1e3:.0f} ms over {len(eval_passes)} passes"
    )
    print(f"achieved model FLOP/s logged by ThroughputMonitor: median {statistics.median(flops) / 1e9:.2f} GFLOP/s")


if __name__ == "__main__":
    main()
