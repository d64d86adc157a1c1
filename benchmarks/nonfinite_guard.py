"""What the non-finite guard costs per step: the loop's step with the guard (Trainer.train_step, which
skips a step whose global gradient norm is not finite, then the window's accounting and the verdict read
one step late) against the same step without it (zero_grad, forward/backward, unscale, clip, optimizer
step, schedule step, the same accounting), alternating in one run of the quickstart under ddp x 2.

One Trainer per rank; after a warm-up, each round times ``--steps`` steps of each variant (the order
alternates from round to round) between barriers, on the same model and data stream. ``--fused on`` uses
fused AdamW, which skips on the device (the default path); ``off`` is foreach, where the verdict is read on
the host before stepping. Prints the median step time of each variant and the
median over rounds of guarded / unguarded. It never asserts; results belong in docs/benchmarks.md.

    .venv/bin/python benchmarks/nonfinite_guard.py --rounds 10 --steps 10 --fused on
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

NPROC = 2


def guarded_step(trainer, window, micro_batches) -> None:
    """What the training loop runs per step with the guard."""
    step = trainer.train_step(micro_batches)
    trainer.progress.step += 1
    trainer.feed.step_done()
    window.add_step(step.loss, finite=step.finite)
    trainer.verdicts.add(trainer.progress.step, step.finite)
    trainer._settle_verdicts(keep_newest=True)


def unguarded_step(trainer, window, micro_batches) -> None:
    """The same step and accounting without the guard: every step applied, no verdict."""
    from paratrain.debug import maybe_dump_gradients
    from paratrain.gradients import clip_grad_norm
    from paratrain.launch import faults

    faults.maybe_stall("stall_in_step", step=trainer.progress.step + 1, rank=trainer.ctx.rank)
    trainer.optimizer.zero_grad(set_to_none=True)
    loss = trainer.engine.forward_backward(micro_batches)
    trainer.precision.unscale_(trainer.optimizer)
    maybe_dump_gradients(
        trainer.bare_model,
        trainer.config.debug,
        trainer.config.run.output_dir,
        step=trainer.progress.step + 1,
        is_main=trainer.ctx.is_main,
        pipeline_group=trainer.pipeline_group,
    )
    clip_grad_norm(
        list(trainer.bare_model.parameters()), trainer.config.train.grad_clip, sum_over=trainer.pipeline_group
    )
    trainer.precision.step(trainer.optimizer)
    trainer.lr_scheduler.step()
    trainer.progress.step += 1
    trainer.feed.step_done()
    window.steps += 1
    window.loss_sum += loss


def worker(rounds: int, steps: int, fused: str, output_dir: str) -> None:
    import torch.distributed as dist

    from paratrain.config.loading import load_config
    from paratrain.tracking.metrics import LogWindow
    from paratrain.training.trainer import Trainer

    dist.init_process_group("gloo")
    overrides = [
        f"run.output_dir={output_dir}",
        "checkpoint.resume=never",
        "train.max_steps=100000",
        f"optim.fused={fused}",
    ]
    trainer = Trainer(load_config("examples/quickstart.yaml", overrides))
    batches, window = trainer.feed.step_batches(), LogWindow.open(trainer.ctx.device)
    variants = {
        "guard": lambda: guarded_step(trainer, window, next(batches)),
        "none": lambda: unguarded_step(trainer, window, next(batches)),
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
        kind = type(trainer.optimizer).__name__ + (" fused" if trainer.optimizer.defaults.get("fused") else " foreach")
        print(f"rounds {rounds} x {steps} steps per variant, ddp x {dist.get_world_size()}, quickstart, {kind}")
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
    parser.add_argument("--fused", choices=["on", "off"], default="on", help="optim.fused (on: device-side skip)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.rounds, args.steps, args.fused, args.output_dir)
        return 0
    from paratrain.launch.launcher import LaunchOptions, launch

    with tempfile.TemporaryDirectory() as output_dir:
        worker_args = ["--worker", "--rounds", str(args.rounds), "--steps", str(args.steps), "--fused", args.fused]
        worker_args += ["--output-dir", output_dir]
        return launch(
            LaunchOptions(nproc_per_node=NPROC), worker_args, env={}, worker_module="benchmarks.nonfinite_guard"
        )


if __name__ == "__main__":
    sys.exit(main())
