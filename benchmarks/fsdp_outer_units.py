"""What sharding a transformers model's embedding, and its final norm with its head, as FSDP units of their
own saves, against leaving them to the root unit (kept gathered from forward into backward), in one run.

A Llama from its config with a large vocabulary (so the embedding and the head are most of the model)
trains under fsdp x 2 on CPU. Each variant is a separate two-process launch, alternating round by round:
``outer`` is paratrain's plan (``ParallelPlan.outer_units``); ``root`` is the same plan with no outer
units (the plan before them). After two warm-up steps each rank resets its peak resident set
(``/proc/self/clear_refs``) and trains ``--steps`` more; the figure is the peak's growth over the
resident set before those steps, per rank. Prints the medians and outer / root; never asserts; results
belong in docs/benchmarks.md.

    .venv/bin/python benchmarks/fsdp_outer_units.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

NPROC = 2
MIB = 1024 * 1024
LLAMA = (
    "{model_type: llama, vocab_size: 32000, hidden_size: 256, intermediate_size: 512, num_hidden_layers: 2, "
    "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 64}"
)


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(variant: str, steps: int, out: str) -> None:
    import torch.distributed as dist

    import paratrain.models.plan_derivation
    from paratrain.config.loading import load_config
    from paratrain.training.trainer import Trainer

    if variant == "root":  # the plan without outer units: embedding, norm and head stay in the root unit
        paratrain.models.plan_derivation.transformers_outer_units = lambda model, blocks: ()
    dist.init_process_group("gloo")
    overrides = [
        "parallel.strategy=fsdp",
        "model.factory=paratrain.models.hf:causal_lm",
        f"model.args={LLAMA}",
        f"run.output_dir={out}/run-{variant}",
        "checkpoint.resume=never",
        "train.max_steps=100000",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "data.args={block_size: 64, max_chars: 20000}",
    ]
    trainer = Trainer(load_config(None, overrides))
    batches = trainer.feed.step_batches()
    for _ in range(2):  # warm-up: FSDP's lazy init, optimizer state, allocator
        trainer.train_step(next(batches))
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from VmRSS
    before = status_bytes("VmRSS")
    for _ in range(steps):
        trainer.train_step(next(batches))
    growth = status_bytes("VmHWM") - before
    Path(out, f"{variant}-rank{dist.get_rank()}.json").write_text(json.dumps({"peak_growth": growth}))
    trainer.close()
    dist.destroy_process_group()


def launch_variant(variant: str, steps: int, out: Path) -> list[float]:
    from paratrain.launch.launcher import LaunchOptions, launch

    args = ["--worker", variant, "--steps", str(steps), "--output-dir", str(out)]
    # Large blocks from mmap, so a freed tensor leaves the resident set at once and the peak tracks what
    # is live (glibc's heap would otherwise keep freed memory and blur the two variants).
    env = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    code = launch(LaunchOptions(nproc_per_node=NPROC), args, env=env, worker_module="benchmarks.fsdp_outer_units")
    if code:
        raise SystemExit(f"the {variant} launch failed with exit code {code}")
    return [
        json.loads(Path(out, f"{variant}-rank{rank}.json").read_text())["peak_growth"] / MIB for rank in range(NPROC)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", choices=["outer", "root"], help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.output_dir)
        return 0
    growth: dict[str, list[float]] = {"outer": [], "root": []}
    with tempfile.TemporaryDirectory() as out:
        for round_index in range(args.rounds):
            for variant in ("outer", "root") if round_index % 2 == 0 else ("root", "outer"):
                growth[variant].append(max(launch_variant(variant, args.steps, Path(out))))
    print(f"Llama {LLAMA}, fsdp x {NPROC}, {args.steps} steps after 2 warm-up steps, {args.rounds} rounds")
    for variant, values in growth.items():
        print(f"{variant:>5}: worst rank's peak growth per round {[round(v, 1) for v in values]} MiB")
    outer, root = statistics.median(growth["outer"]), statistics.median(growth["root"])
    print(f"median outer {outer:.1f} MiB, root {root:.1f} MiB, outer / root {outer / root:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
