"""One measured run for ``fsdp_memory.py``: a few paratrain training steps under one layout, then
this rank's model-state bytes, peak resident memory and per-step wall times.

It trains through the Python API (``paratrain.Trainer`` and its ``train_step``) rather than the CLI
so it can look at the optimizer and the parameters after the last step, while that step's gradients
are still held (``train_step`` clears gradients at its start, not its end). Rank 0 writes one JSON
file with every rank's numbers.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/fsdp_memory_worker.py --strategy fsdp --out result.json --output-dir DIR
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import paratrain


@dataclass(frozen=True)
class TensorBytes:
    """Bytes of a set of tensors, counted two ways.

    ``logical`` is numel x element size of each (local) tensor: what the ZeRO formulas count.
    ``storage`` is the size of the distinct storages behind them, as torch allocated them: it would
    include FSDP2's padding of uneven dim-0 shards, and whole DDP buckets when gradients are views
    into them.
    """

    logical: int
    storage: int
    num_tensors: int
    num_storages: int  # fewer than num_tensors when tensors are views into shared buffers


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own piece: the shard of a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def count_bytes(tensors: Iterable[torch.Tensor]) -> TensorBytes:
    local = [local_tensor(tensor) for tensor in tensors]
    logical = sum(tensor.numel() * tensor.element_size() for tensor in local)
    # Views share a storage (DDP's bucket views, FSDP2's per-group reduce-scatter output): count it once.
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in local}
    return TensorBytes(logical, sum(storages.values()), len(local), len(storages))


def optimizer_tensors(optimizer: torch.optim.Optimizer, *, step_counters: bool) -> list[torch.Tensor]:
    """Adam's moment tensors (exp_avg, exp_avg_sq), or else its per-parameter scalar ``step`` tensors."""
    return [
        value
        for state in optimizer.state.values()
        for name, value in state.items()
        if isinstance(value, torch.Tensor) and (name == "step") == step_counters
    ]


def model_state_bytes(trainer: paratrain.Trainer) -> dict[str, dict[str, int]]:
    """Parameters, gradients and optimizer state as this rank holds them right now."""
    params = list(trainer.bare_model.parameters())
    counted = {
        "params": count_bytes(params),
        "grads": count_bytes(p.grad for p in params if p.grad is not None),
        "optim_moments": count_bytes(optimizer_tensors(trainer.optimizer, step_counters=False)),
        "optim_steps": count_bytes(optimizer_tensors(trainer.optimizer, step_counters=True)),
    }
    return {name: asdict(value) for name, value in counted.items()}


def parameter_count(trainer: paratrain.Trainer) -> int:
    """Ψ: the full model's parameter count (DTensor.numel() is the global size)."""
    return sum(param.numel() for param in trainer.bare_model.parameters())


def resident_kib() -> int:
    """This process's resident memory right now (VmRSS), in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS line in /proc/self/status (Linux only)")


def timed_steps(trainer: paratrain.Trainer, *, warmup_steps: int, timed: int) -> list[float]:
    """Wall seconds of each timed step on this rank; every step starts at a barrier, so one rank's
    lag is not carried into the next step's time of another."""
    batches = trainer.feed.step_batches()
    for _ in range(warmup_steps):
        trainer.train_step(next(batches))
    times = []
    for _ in range(timed):
        micro_batches = next(batches)
        dist.barrier()
        started = time.perf_counter()
        trainer.train_step(micro_batches).loss.item()
        times.append(time.perf_counter() - started)
    return times


def build_config(args: argparse.Namespace) -> paratrain.Config:
    model_args = (
        f"{{block_size: {args.block_size}, n_layer: {args.n_layer}, n_head: {args.n_head}, n_embd: {args.n_embd}}}"
    )
    return paratrain.load_config(
        None,
        [
            f"parallel.strategy={args.strategy}",
            f"run.output_dir={args.output_dir}",
            f"train.max_steps={args.warmup_steps + args.timed_steps}",
            f"train.seed={args.seed}",
            f"train.global_batch_size={args.global_batch_size}",
            f"train.micro_batch_size={args.micro_batch_size}",
            "optim.name=adamw",
            "optim.lr=3e-3",
            "optim.weight_decay=0.1",
            "model.factory=paratrain.models.gpt:build_gpt",
            f"model.args={model_args}",
            "data.factory=paratrain.data.text:build_char_dataset",
            f"data.args={{block_size: {args.block_size}}}",
            "checkpoint.save_final=false",
            *args.override,
        ],
    )


def measure(trainer: paratrain.Trainer, args: argparse.Namespace, *, rss_before_kib: int) -> dict:
    """This rank's numbers, taken after the last timed step."""
    step_times = timed_steps(trainer, warmup_steps=args.warmup_steps, timed=args.timed_steps)
    return {
        "rank": trainer.ctx.rank,
        "params_numel": parameter_count(trainer),
        "bytes": model_state_bytes(trainer),
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,  # KiB on Linux
        "rss_after_kib": resident_kib(),
        # torch and paratrain imported, nothing built yet: roughly the runtime's own share.
        "rss_before_trainer_kib": rss_before_kib,
        "step_times_s": step_times,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], required=True)
    parser.add_argument("--out", type=Path, required=True, help="JSON file rank 0 writes")
    parser.add_argument("--output-dir", type=Path, required=True, help="the run's run.output_dir")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--timed-steps", type=int, default=10)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra paratrain config override, e.g. parallel.fsdp.reshard_after_forward=false",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    rss_before_kib = resident_kib()
    trainer = paratrain.Trainer(build_config(args))
    try:
        mine = measure(trainer, args, rss_before_kib=rss_before_kib)
        everyone = [None] * trainer.ctx.world_size
        dist.all_gather_object(everyone, mine)
        if trainer.ctx.is_main:
            result = {
                "world_size": trainer.ctx.world_size,
                "strategy": args.strategy,
                "torch": torch.__version__,
                "ranks": everyone,
            }
            args.out.write_text(json.dumps(result, indent=1))
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
