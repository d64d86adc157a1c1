"""How long a checkpoint save blocks training: synchronous against ``checkpoint.async_save``.

One process, paratrain's own ``Checkpointer`` on a model of ``--layers`` square linears (the default
is 105 MB of fp32 parameters) whose AdamW state has been filled by a step, so each save writes
parameters + both moments (about 3x the parameter bytes). Each round saves once synchronously and
once asynchronously, the order flipping every round (S A, A S, ...) on a machine shared with others.

- *blocked*: from the save call to its return, i.e. until training may go on. Synchronous: the whole
  save (DCP write with fsync, manifest with each file's checksum). Asynchronous: the copy of the state
  into CPU memory and starting the background thread.
- *background*: asynchronous only, from the call until the checkpoint is complete (manifest written).
  Training steps run meanwhile, as they would in a run, and their median time is printed beside the
  median of steps with no save in flight: the cost of the background write to training.
- *lost*: background time minus the steps done meanwhile at their undisturbed median time: the
  training time the asynchronous save cost in all, to set against the synchronous blocked time. On a
  CPU-only machine the background write competes with training for the cores; with training on GPUs
  it mostly waits on the disk.

Target: async blocked <= 0.2 x sync blocked. This prints, it never asserts; results belong
in docs/benchmarks.md.

    .venv/bin/python benchmarks/async_checkpoint.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from paratrain.checkpoint import Checkpointer
from paratrain.checkpoint.state import ModelState, OptimizerState, Progress

TARGET = 0.2


@dataclass
class Round:
    order: str
    sync_blocked_s: float
    async_blocked_s: float
    async_background_s: float
    steps_during_write: list[float]


def build_training(*, width: int, layers: int, batch: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs = torch.randn(batch, width)
    train_step(model, optimizer, inputs)  # fills AdamW's moments, which every save then writes
    return model, optimizer, inputs


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor) -> float:
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    model(inputs).square().mean().backward()
    optimizer.step()
    return time.perf_counter() - started


def save_sync(checkpointer: Checkpointer, step: int, state: dict) -> float:
    started = time.perf_counter()
    checkpointer.save(step, state, blocking=True)
    return time.perf_counter() - started


def save_async(
    checkpointer: Checkpointer, step: int, state: dict, model, optimizer, inputs
) -> tuple[float, float, list[float]]:
    """(blocked, background, times of the training steps run while the write was in flight)."""
    started = time.perf_counter()
    checkpointer.save(step, state, blocking=False)
    blocked = time.perf_counter() - started
    in_flight = checkpointer.writer._in_flight  # the benchmark peeks: train until the write is complete
    steps = []
    while in_flight is not None and not in_flight.done.done():
        steps.append(train_step(model, optimizer, inputs))
    checkpointer.wait()
    return blocked, time.perf_counter() - started, steps


def run_round(index: int, checkpointer: Checkpointer, state: dict, model, optimizer, inputs) -> Round:
    order = "SA" if index % 2 == 0 else "AS"
    sync_s = async_s = background_s = 0.0
    steps: list[float] = []
    for kind in order:
        step = 2 * index + (1 if kind == order[0] else 2)
        state["progress"].step = step
        if kind == "S":
            sync_s = save_sync(checkpointer, step, state)
        else:
            async_s, background_s, steps = save_async(checkpointer, step, state, model, optimizer, inputs)
    return Round(order, sync_s, async_s, background_s, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2560)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    model, optimizer, inputs = build_training(width=args.width, layers=args.layers, batch=args.batch)
    param_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    baseline = [train_step(model, optimizer, inputs) for _ in range(10)]
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        checkpointer = Checkpointer(Path(scratch), keep_last=1, rank=0, world_size=1, config={}, async_save=True)
        state = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer), "progress": Progress()}
        rounds = [run_round(i, checkpointer, state, model, optimizer, inputs) for i in range(args.rounds)]
        checkpoint_mb = sum(f.stat().st_size for f in Path(scratch).rglob("*") if f.is_file()) / 1e6
        checkpointer.close()

    print(
        f"model: {args.layers} x Linear({args.width}, {args.width}), {param_mb:.0f} MB of parameters; "
        f"checkpoint {checkpoint_mb:.0f} MB (with AdamW moments); torch {torch.__version__}, 1 thread"
    )
    step_s = statistics.median(baseline)
    print(
        "| round | order | sync blocked s | async blocked s | async background s | steps during write | "
        "async lost s | async/sync blocked |"
    )
    print("|---|---|---|---|---|---|---|---|")
    lost = [r.async_background_s - len(r.steps_during_write) * step_s for r in rounds]
    for i, (r, lost_s) in enumerate(zip(rounds, lost), 1):
        print(
            f"| {i} | {' '.join(r.order)} | {r.sync_blocked_s:.3f} | {r.async_blocked_s:.3f} | "
            f"{r.async_background_s:.3f} | {len(r.steps_during_write)} | {lost_s:.3f} | "
            f"{r.async_blocked_s / r.sync_blocked_s:.3f} |"
        )
    sync_med = statistics.median(r.sync_blocked_s for r in rounds)
    async_med = statistics.median(r.async_blocked_s for r in rounds)
    background_med = statistics.median(r.async_background_s for r in rounds)
    during = [s for r in rounds for s in r.steps_during_write]
    print(
        f"| median | | {sync_med:.3f} | {async_med:.3f} | {background_med:.3f} | | {statistics.median(lost):.3f} | "
        f"{async_med / sync_med:.3f} |"
    )
    verdict = "met" if async_med <= TARGET * sync_med else "MISSED"
    print(f"target async blocked <= {TARGET} x sync blocked: {verdict} ({async_med / sync_med:.3f})")
    print(
        f"training step: median {step_s * 1e3:.0f} ms with no save in flight, "
        f"{statistics.median(during) * 1e3 if during else float('nan'):.0f} ms during background writes "
        f"({len(during)} steps)"
    )


if __name__ == "__main__":
    main()
