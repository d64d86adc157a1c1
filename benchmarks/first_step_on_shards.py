"""The optimizer step and the gradient norm on each rank's shards (paratrain's) against the same on the DTensors
(torch's AdamW and DTensor's norm), side by side, in fresh processes.

Each round launches two fsdp x 2 jobs of the quickstart's tiny GPT under torchrun, one per way, in alternating
order (a drift of the machine's speed favours neither). Each job builds paratrain's Trainer and takes ``--steps``
steps by hand, timing the gradient norm with clipping (``clip_grad_norm``) and the optimizer step apart: the first
step is a fresh process's, where DTensor works out the sharding of every distinct op once (what a restarted
replica group's live peers wait for), the later ones are steady. The DTensor way is paratrain's code with its two
shard paths turned off. Prints each round and the medians of clip + optimizer, first step and steady, and the
ratios shards / DTensors. Not part of the suite; results belong in docs/benchmarks.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/first_step_on_shards.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WAYS = ["DTensors", "shards"]


def worker(way: str, work: Path, steps: int) -> None:
    """One rank of a job: ``steps`` timed steps; rank 0 writes {clip, optimizer: [ms per step]} to ``work``."""
    import torch

    from paratrain import gradients, optim
    from paratrain.config import load_config
    from paratrain.nonfinite import step_optimizer
    from paratrain.training.trainer import Trainer
    from tests.harness import tiny_config, write_config

    if way == "DTensors":
        optim.laid_out_like_their_parameters = lambda lists: False
        gradients._group_norm = lambda grads: gradients._as_plain(torch.nn.utils.get_total_norm(grads))
    rank = int(os.environ["RANK"])
    out = work / f"{way}-run"
    config = tiny_config(out, train={"max_steps": steps, "global_batch_size": 8, "micro_batch_size": 4})
    config["parallel"] = {"dp_shard": 2}
    trainer = Trainer(load_config(str(write_config(work / f"{way}-{rank}.yaml", config))))
    batches, times = trainer.feed.step_batches(), {"clip": [], "optimizer": []}
    for _ in range(steps):
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.engine.forward_backward(next(batches))
        started = time.perf_counter()
        norm = gradients.clip_grad_norm(list(trainer.bare_model.parameters()), 1.0)
        clipped = time.perf_counter()
        step_optimizer(trainer.optimizer, norm, precision=trainer.precision)
        stepped = time.perf_counter()
        times["clip"].append(1000 * (clipped - started))
        times["optimizer"].append(1000 * (stepped - clipped))
    if rank == 0:
        (work / f"{way}.json").write_text(json.dumps(times))
    trainer.close()


def launch(way: str, work: Path, steps: int) -> dict[str, list[float]]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [*command, "--worker", way, "--work", str(work), "--steps", str(steps)],
        env=env,
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    return json.loads((work / f"{way}.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--worker", choices=WAYS)
    parser.add_argument("--work", type=Path)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.work, args.steps)
        return
    work = Path(tempfile.mkdtemp(prefix="first-step-on-shards-"))
    print(f"fsdp x 2, {args.steps} steps a job, clip + optimizer in ms ({work})")
    print("| round | DTensors: first step, steady | shards: first step, steady | first, shards / DTensors | steady |")
    print("|---|---|---|---|---|")
    ratios: dict[str, list[float]] = {"first": [], "steady": []}
    medians: dict[str, dict[str, list[float]]] = {way: {"first": [], "steady": []} for way in WAYS}
    for round_index in range(args.rounds):
        results = {}
        for way in WAYS if round_index % 2 == 0 else reversed(WAYS):
            times = launch(way, work, args.steps)
            both = [clip + step for clip, step in zip(times["clip"], times["optimizer"])]
            results[way] = (both[0], statistics.median(both[1:]))
            medians[way]["first"].append(both[0])
            medians[way]["steady"].append(results[way][1])
        first, steady = (results["shards"][i] / results["DTensors"][i] for i in (0, 1))
        ratios["first"].append(first)
        ratios["steady"].append(steady)
        cells = " | ".join(f"{results[way][0]:.1f}, {results[way][1]:.2f}" for way in WAYS)
        print(f"| {round_index} | {cells} | {first:.3f} | {steady:.3f} |", flush=True)
    cells = " | ".join(
        f"{statistics.median(medians[way]['first']):.1f}, {statistics.median(medians[way]['steady']):.2f}"
        for way in WAYS
    )
    print(
        f"| median | {cells} | **{statistics.median(ratios['first']):.3f}** "
        f"({min(ratios['first']):.3f}-{max(ratios['first']):.3f}) | **{statistics.median(ratios['steady']):.3f}** "
        f"({min(ratios['steady']):.3f}-{max(ratios['steady']):.3f}) |"
    )


if __name__ == "__main__":
    main()
