"""What the non-finite guard costs per step: Trainer.train_step (which reads the global gradient norm on
the host and decides whether to step) against the same step without the guard (the step as it was
before: zero_grad, forward/backward, unscale, clip, optimizer step, schedule step), alternating in one
run of the quickstart under ddp x 2.

One Trainer per rank; after a warm-up, each round times ``--steps`` steps of each variant (the order
alternates from round to round) between barriers, on the same model and data stream. Prints the median
step time of each variant and the median over rounds of guarded / unguarded. It never asserts; results
belong in docs/benchmarks.md.

    .venv/bin/python benchmarks/nonfinite_guard.py --rounds 10 --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

NPROC = 2


def unguarded_step(trainer, micro_batches) -> None:
    """Trainer.train_step as it was before the guard: every step applied."""
    from paratrain.launch import faults

    faults.maybe_stall("stall_in_step", step=trainer.progress.step + 1, rank=trainer.ctx.rank)
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.engine.forward_backward(micro_batches)
    trainer.precision.unscale_(trainer.optimizer)
    trainer._maybe_dump_gradients()
    trainer._clip_gradients()
    trainer.precision.step(trainer.optimizer)
    trainer.lr_scheduler.step()


def worker(rounds: int, steps: int, output_dir: str) -> None:
    import torch.distributed as dist

    from paratrain.config.schema import load_config
    from paratrain.trainer import Trainer

    dist.init_process_group("gloo")
    overrides = [f"run.output_dir={output_dir}", "checkpoint.resume=never", "train.max_steps=100000"]
    trainer = Trainer(load_config("examples/quickstart.yaml", overrides))
    batches = trainer.step_batches()
    variants = {
        "guard": lambda: trainer.train_step(next(batches)),
        "none": lambda: unguarded_step(trainer, next(batches)),
    }
    for _ in range(3):  # warm-up: allocator, DDP buckets
        variants["none"]()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(rounds):
        order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
        for name in order:
            dist.barrier()
            started = time.perf_counter()
            for _ in range(steps):
                variants[name]()
            dist.barrier()
            times[name].append((time.perf_counter() - started) / steps)
    if dist.get_rank() == 0:
        ratios = [guard / none for guard, none in zip(times["guard"], times["none"], strict=True)]
        print(f"rounds {rounds} x {steps} steps per variant, ddp x {dist.get_world_size()}, quickstart")
        for name, values in times.items():
            print(f"{name:>5}: median step {statistics.median(values) * 1e3:.2f} ms")
        print(
            f"guard / none: median over rounds {statistics.median(ratios):.4f} (min {min(ratios):.4f}, max {max(ratios):.4f})"
        )
    trainer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.rounds, args.steps, args.output_dir)
        return 0
    from paratrain.launch.launcher import LaunchOptions, launch

    with tempfile.TemporaryDirectory() as output_dir:
        worker_args = ["--worker", "--rounds", str(args.rounds), "--steps", str(args.steps), "--output-dir", output_dir]
        return launch(
            LaunchOptions(nproc_per_node=NPROC), worker_args, env={}, worker_module="benchmarks.nonfinite_guard"
        )


if __name__ == "__main__":
    sys.exit(main())
