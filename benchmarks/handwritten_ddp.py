"""A hand-written torch DDP training loop: the baseline that ``ddp_overhead.py`` holds paratrain to.

Plain torch, as a user would write it from the DDP tutorials, doing exactly the work of one paratrain
``ddp`` step: same GPT from the same initial weights, same character data and sample order, same
global batch cut into the same micro-batches, ``no_sync()`` on all but the last, clipping, AdamW with
the same groups and a warm-up + cosine schedule. Every ``--log-every`` steps (and step 1 and the
last) it averages the loss over ranks and writes a ``metrics.jsonl`` line in paratrain's format,
with the step time measured the way paratrain measures it, so both runs are read by the same code.

Start it like a user would:
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/handwritten_ddp.py --out-dir DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, Dataset

from paratrain.data.text import build_char_dataset
from paratrain.models.gpt import build_gpt

# paratrain's defaults for what the benchmark does not set (OptimConfig, TrainConfig).
BETAS, EPS, MIN_LR_RATIO, GRAD_CLIP = (0.9, 0.95), 1e-8, 0.1, 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Hand-written DDP baseline for benchmarks/ddp_overhead.py.")
    parser.add_argument("--out-dir", type=Path, required=True, help="where rank 0 writes metrics.jsonl")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=64)
    return parser.parse_args(argv)


def rank_micro_batches(num_samples: int, args: argparse.Namespace, rank: int, world_size: int) -> Iterator[list[int]]:
    """This rank's micro-batches of indices, endlessly: each epoch is a seeded permutation cut into
    global batches; rank r takes the r-th slice of each (the order paratrain's sampler defines)."""
    per_rank = args.global_batch_size // world_size
    epoch = 0
    while True:
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + epoch)
        order = torch.randperm(num_samples, generator=generator)
        for start in range(0, num_samples - args.global_batch_size + 1, args.global_batch_size):
            mine = order[start + rank * per_rank : start + (rank + 1) * per_rank].tolist()
            yield from (mine[i : i + args.micro_batch_size] for i in range(0, per_rank, args.micro_batch_size))
        epoch += 1


def step_batches(dataset: Dataset, args: argparse.Namespace, rank: int, world_size: int) -> Iterator[list]:
    """Lists of collated micro-batches, one list per optimizer step."""
    loader = DataLoader(dataset, batch_sampler=rank_micro_batches(len(dataset), args, rank, world_size))
    micro_batches = iter(loader)
    accumulation_steps = args.global_batch_size // (args.micro_batch_size * world_size)
    while True:
        yield [next(micro_batches) for _ in range(accumulation_steps)]


def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    # Decay matrices only, as GPT-2 does; foreach=True as paratrain asks (on CPU torch's default is the
    # per-parameter loop, which would make this a comparison of two AdamW kernels, not of two loops).
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=BETAS, eps=EPS, foreach=True)


def lr_multiplier(step: int, *, warmup_steps: int, max_steps: int) -> float:
    """Linear warm-up, then cosine decay to MIN_LR_RATIO of the peak at max_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return MIN_LR_RATIO + (1.0 - MIN_LR_RATIO) * 0.5 * (1.0 + math.cos(math.pi * progress))


def train_step(
    model: DistributedDataParallel, optimizer: torch.optim.Optimizer, scheduler: LambdaLR, micro_batches: list
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One optimizer step; gradients are all-reduced only on the last micro-batch."""
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros(())
    for index, (inputs, targets) in enumerate(micro_batches):
        is_last = index == len(micro_batches) - 1
        with contextlib.nullcontext() if is_last else model.no_sync():
            logits = model(inputs)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
            (loss / len(micro_batches)).backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    return loss_sum / len(micro_batches), grad_norm, lr


def log_record(
    *,
    step: int,
    window_loss: torch.Tensor,
    window_steps: int,
    window_started: float,
    grad_norm: torch.Tensor,
    lr: float,
    args: argparse.Namespace,
) -> dict:
    """Averages the window's loss over ranks (which also waits for its work) and times the window."""
    loss = window_loss / window_steps
    dist.all_reduce(loss)
    loss = loss.item() / dist.get_world_size()
    step_time = (time.perf_counter() - window_started) / window_steps
    return {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm.item(),
        "step_time_s": step_time,
        "samples_per_s": args.global_batch_size / step_time,
        "world_size": dist.get_world_size(),
        "time": time.time(),
    }


def init_weights_by_name(model: nn.Module, seed: int) -> None:
    """Redraws every tensor from a generator seeded by (seed, name), as paratrain initialises a model
    that declares ``init_parameter``: both loops then start from the same weights, so the benchmark
    can check that they logged the same losses."""
    if not hasattr(model, "init_parameter"):
        return  # a paratrain that initialises under torch.manual_seed alone, as build_gpt just did
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            model.init_parameter(name, tensor, generator)


def build_training(args: argparse.Namespace) -> tuple:
    """The DDP model, optimizer, lr schedule and dataset, in the order paratrain builds them."""
    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = build_gpt(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    init_weights_by_name(model, args.seed)
    ddp_model = DistributedDataParallel(model, gradient_as_bucket_view=True)  # as paratrain's DDPConfig default
    optimizer = build_optimizer(model, args)
    scheduler = LambdaLR(
        optimizer, lambda step: lr_multiplier(step, warmup_steps=args.warmup_steps, max_steps=args.steps)
    )
    dataset = build_char_dataset(block_size=args.block_size)
    return ddp_model, optimizer, scheduler, dataset


def train(args: argparse.Namespace) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer, scheduler, dataset = build_training(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    batches = step_batches(dataset, args, rank, world_size)
    window_loss, window_steps, window_started = torch.zeros(()), 0, time.perf_counter()
    for step in range(1, args.steps + 1):
        loss, grad_norm, lr = train_step(model, optimizer, scheduler, next(batches))
        window_loss, window_steps = window_loss + loss, window_steps + 1
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            record = log_record(
                step=step,
                window_loss=window_loss,
                window_steps=window_steps,
                window_started=window_started,
                grad_norm=grad_norm,
                lr=lr,
                args=args,
            )
            if rank == 0:
                with open(args.out_dir / "metrics.jsonl", "a") as metrics:
                    metrics.write(json.dumps(record) + "\n")
            window_loss, window_steps, window_started = torch.zeros(()), 0, time.perf_counter()


def main() -> None:
    dist.init_process_group("gloo")
    try:
        # The DDP model lives inside train(), so it is freed before the group is destroyed: a reducer
        # that outlives its gloo group can deadlock the process at exit (pytorch#56297).
        train(parse_args())
        # Both ranks leave the group together: a rank that destroyed it while the other was still in its
        # last collective aborted at exit ("terminate called without an active exception"), about 1 run in 6.
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
