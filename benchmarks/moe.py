"""Expert parallel: per-rank parameter memory at ep 1/2/4, and the all-to-all's share of step time on CPU.

Each run trains paratrain's MoE GPT (8 experts, top-2), or with ``--model qwen3_moe`` a transformers
Qwen3-MoE of the same size (its own router and stacked experts, dispatched by paratrain), laid out by
paratrain's own ``parallelize``
(FSDP over dp_shard, ``parallel.ep`` borrowing its ranks) in ``world`` gloo processes on this machine,
and reports from every rank's own tensors:

- *experts held*: bytes of expert parameters a rank stores (its FSDP shard of its ep share);
- *experts computed*: bytes of expert weights a rank computes with once FSDP has gathered them (its
  ep share: measured inside the experts' forward). The goal: ``full / ep`` within 2 %;
- *other held*: the rest of the model's parameter bytes a rank stores (sharded over all dp_shard ranks,
  whatever ep is);
- *step* and *all-to-all*: median step time, and the share of it spent in all-to-all collectives (rank
  0): the counts' exchange, the dispatch and the combine in forward, timed around each call until its
  result is there, and their backward, timed between stamps autograd runs just before and just after it.

``world:ep`` pairs choose the runs: with world = ep every rank holds exactly its experts; at a fixed
world of 4, ep moves expert memory from "held" (FSDP shards it anyway) to "computed" (what is gathered).
This prints, it never asserts: results belong in docs/benchmarks.md.

    .venv/bin/python benchmarks/moe.py --runs 1:1 2:2 4:4 4:2 4:1 --steps 6
    .venv/bin/python benchmarks/moe.py --model qwen3_moe --runs 1:1 2:2 4:4 4:2 4:1 --steps 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import paratrain.parallel.expert as expert_parallel
from paratrain.config.schema import ParallelConfig
from paratrain.models.gpt import build_gpt
from paratrain.models.hf import causal_lm
from paratrain.models.init import materialize
from paratrain.models.plan_derivation import plan_of
from paratrain.parallel.dims import ParallelDims
from paratrain.parallel.expert import expert_modules
from paratrain.parallel.parallelize import parallelize

GOAL = 0.02  # experts computed per rank within 2 % of full / ep
SEQ = 64
MODELS = {
    "gpt": lambda: build_gpt(vocab_size=256, block_size=SEQ, n_layer=2, n_head=4, n_embd=128, moe_experts=8),
    # The same shape as transformers' Qwen3-MoE: 8 experts of 128 -> 512 (gate and up) -> 128, top-2.
    "qwen3_moe": lambda: causal_lm(
        model_type="qwen3_moe",
        vocab_size=256,
        hidden_size=128,
        intermediate_size=512,
        moe_intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=SEQ,
    ),
}
VOCAB = 256
BATCH = 8  # samples per rank and step


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


class Clock:
    """Seconds spent in all-to-all collectives, forward and backward, since the last ``reset``."""

    def __init__(self):
        self.seconds, self._backward_started = 0.0, []

    def time_collectives(self) -> None:
        """Wraps the collectives paratrain.parallel.expert calls (this process only)."""
        differentiable, counts = expert_parallel.all_to_all_single_autograd, dist.all_to_all_single

        def timed_differentiable(x, output_sizes, input_sizes, group):
            start = time.perf_counter()
            x = _Stamp.apply(x, self, "end")  # its backward runs after the collective's backward
            y = _Stamp.apply(differentiable(x, output_sizes, input_sizes, group), self, "start")
            self.seconds += time.perf_counter() - start  # the stamp's forward waited for the result
            return y

        def timed_counts(*args, **kwargs):
            start = time.perf_counter()
            counts(*args, **kwargs)
            self.seconds += time.perf_counter() - start

        expert_parallel.all_to_all_single_autograd = timed_differentiable
        dist.all_to_all_single = timed_counts

    def stamp(self, which: str) -> None:
        if which == "start":
            self._backward_started.append(time.perf_counter())
        else:
            self.seconds += time.perf_counter() - self._backward_started.pop()


class _Stamp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, clock, which):
        ctx.clock, ctx.which = clock, which
        return x * 1  # an op on the collective's result waits for it

    @staticmethod
    def backward(ctx, grad):
        grad = grad * 1  # likewise for the collective's gradient
        ctx.clock.stamp(ctx.which)
        return grad, None, None


def worker(rank: int, world: int, ep: int, steps: int, store_path: str, results: dict, name: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    degrees = {"dp_shard": world, "ep": ep} if world > 1 else {}
    dims = ParallelDims.resolve(None if world > 1 else "single", world_size=world, degrees=degrees).with_mesh("cpu")
    factory = MODELS[name]
    with torch.device("meta"):
        model = factory()
    plan = plan_of(model)
    parallelize(model, dims, plan=plan, options=ParallelConfig())
    materialize(model, factory=factory, device=torch.device("cpu"), seed=0)
    computed = {}  # per experts module: the weight bytes it computed with (gathered by FSDP, its ep share)
    for module in expert_modules(model, plan):
        module.register_forward_pre_hook(
            lambda m, *_: computed.__setitem__(id(m), sum(local_bytes(p) for p in m.parameters(recurse=False)))
        )
    clock = Clock()
    clock.time_collectives()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    times, a2a = [], []
    for step in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        if world > 1:
            dist.barrier()  # each step starts together, so waits for a slower rank stay inside the step
        clock.seconds, start = 0.0, time.perf_counter()
        out = model(tokens[:, :-1])
        loss = F.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten()) + out.weighted_aux_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step >= 2:  # the first steps warm up allocators and process groups
            times.append(time.perf_counter() - start)
            a2a.append(clock.seconds)
    params = dict(model.named_parameters())
    experts = sum(local_bytes(p) for name, p in params.items() if ".experts." in name)
    others = sum(local_bytes(p) for name, p in params.items() if ".experts." not in name)
    if rank == 0:
        share = statistics.median(a / t for a, t in zip(a2a, times, strict=True))
        results[(world, ep)] = (experts, sum(computed.values()), others, statistics.median(times), share)
    if world > 1:
        dist.destroy_process_group()


def full_expert_bytes(name: str) -> int:
    with torch.device("meta"):
        model = MODELS[name]()
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".experts." in name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", nargs="+", default=["1:1", "2:2", "4:4", "4:2", "4:1"], help="world:ep pairs")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt")
    args = parser.parse_args()
    full = full_expert_bytes(args.model)
    print(
        f"{args.model}: 8 experts of 128 -> 512 -> 128, top-2, {BATCH} samples x {SEQ} tokens per rank and step, fp32"
    )
    print(f"all experts: {full / 2**20:.2f} MiB; goal: experts computed per rank = full / ep within {GOAL:.0%}")
    print("world  ep  experts held MiB  experts computed MiB  vs full/ep  other held MiB  step ms  all-to-all")
    results = mp.Manager().dict()
    for run in args.runs:
        world, ep = (int(part) for part in run.split(":"))
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(worker, args=(world, ep, args.steps, f"{tmp}/store", results, args.model), nprocs=world)
        held, computed, others, step, share = results[(world, ep)]
        ratio = computed / (full / ep)
        print(
            f"{world:5d} {ep:3d}  {held / 2**20:16.3f}  {computed / 2**20:20.3f}  {ratio:9.4f}  "
            f"{others / 2**20:14.3f}  {step * 1e3:7.1f}  {share:9.1%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
