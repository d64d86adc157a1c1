"""Context parallel's activation memory per rank, and what document masking costs.

Memory: each cp rank runs one training forward of paratrain's GPT on its share of one sample, through the
same SequenceSharding and all_to_all exchange training uses (gloo, one process per rank on loopback),
and counts the bytes autograd saves for backward (each tensor's storage once, parameters left out) plus
the logits: the activations a rank holds at the end of forward. Printed per sequence length and cp, with
the ratio to cp=1 and the goal 1/cp + 10 %.

Document cost: one process, the time of a forward and backward with attention within documents (causal SDPA
on each document alone: parallel/documents.py) against plain causal attention over the whole window (SDPA's
is_causal kernel), on the same windows, alternating within each round; the median ratio over rounds.

    .venv/bin/python benchmarks/context_parallel.py --seq-lens 2048 4096 8192 --cps 1 2 4
    .venv/bin/python benchmarks/context_parallel.py --mask-cost --seq-lens 1024 2048 --rounds 5

This prints, it never asserts: results belong in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.autograd.graph import saved_tensors_hooks

from paratrain.models.attention_hooks import install_sequence_functions
from paratrain.models.gpt import build_gpt
from paratrain.parallel.documents import EndToken
from paratrain.parallel.sequence_sharding import SequenceSharding

GOAL_SLACK = 0.10
MODEL = {"vocab_size": 512, "n_layer": 2, "n_head": 8, "n_embd": 128}
EOS = 0


def saved_bytes(model: torch.nn.Module, run_forward) -> int:
    """Bytes autograd keeps for backward during ``run_forward()`` plus its output (storages counted once,
    parameters left out), as planner.activations.measure_saved_bytes counts them."""
    params = {param.untyped_storage().data_ptr() for param in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        output = run_forward()
    return sum(saved.values()) + output.numel() * output.element_size()


def one_sample(seq_len: int, *, documents: bool) -> torch.Tensor:
    tokens = torch.randint(1, MODEL["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(0))
    if documents:
        tokens[0, 300::300] = EOS  # a document every 300 tokens
    return tokens


def rank_activation_bytes(rank: int, cp: int, seq_len: int, port: int, documents: bool, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    torch.manual_seed(0)
    model = build_gpt(block_size=seq_len, **MODEL)
    sharding = SequenceSharding(
        cp=cp,
        cp_rank=rank,
        cp_group=dist.group.WORLD if cp > 1 else None,
        documents=EndToken(EOS) if documents else None,
    )
    install_sequence_functions(model, attention=sharding.attention, positions=sharding.positions)
    tokens = one_sample(seq_len, documents=documents)
    inputs, _ = sharding.shard(tokens, tokens)
    out[(cp, seq_len, rank)] = saved_bytes(model, lambda: model(inputs))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def memory_table(seq_lens: list[int], cps: list[int], *, documents: bool) -> None:
    manager = mp.Manager()
    results = manager.dict()
    print(f"activation bytes per rank, one sample, GPT {MODEL}, document mask {documents}")
    print(f"{'seq':>6} {'cp':>3} {'MiB per rank (max)':>19} {'/ cp=1':>8} {'goal <=':>8}")
    for seq_len in seq_lens:
        baseline = None
        for cp in cps:
            mp.spawn(rank_activation_bytes, args=(cp, seq_len, free_port(), documents, results), nprocs=cp, join=True)
            per_rank = max(results[(cp, seq_len, rank)] for rank in range(cp))
            baseline = baseline or per_rank
            goal = 1 / cp + GOAL_SLACK
            print(f"{seq_len:>6} {cp:>3} {per_rank / 2**20:>19.1f} {per_rank / baseline:>8.3f} {goal:>8.3f}")


def step_seconds(model: torch.nn.Module, sharding: SequenceSharding | None, tokens: torch.Tensor) -> float:
    started = time.perf_counter()
    inputs = sharding.shard(tokens, tokens)[0] if sharding is not None else tokens
    model(inputs).float().logsumexp(-1).mean().backward()
    if sharding is not None:
        sharding.release()
    return time.perf_counter() - started


def mask_cost_table(seq_lens: list[int], rounds: int) -> None:
    print("document masking: forward + backward seconds, one process, batch 2, median ratio over rounds")
    print(f"{'seq':>6} {'causal s':>9} {'masked s':>9} {'ratio':>7}")
    for seq_len in seq_lens:
        torch.manual_seed(0)
        plain, masked = build_gpt(block_size=seq_len, **MODEL), build_gpt(block_size=seq_len, **MODEL)
        sharding = SequenceSharding(cp=1, cp_rank=0, cp_group=None, documents=EndToken(EOS))
        install_sequence_functions(masked, attention=sharding.attention, positions=sharding.positions)
        tokens = torch.cat([one_sample(seq_len, documents=True)] * 2)
        step_seconds(plain, None, tokens), step_seconds(masked, sharding, tokens)  # warm-up
        times = {"causal": [], "masked": []}
        for round_index in range(rounds):
            order = ("causal", "masked") if round_index % 2 == 0 else ("masked", "causal")
            for name in order:
                model, cut = (plain, None) if name == "causal" else (masked, sharding)
                times[name].append(step_seconds(model, cut, tokens))
        ratios = [m / c for m, c in zip(times["masked"], times["causal"])]
        causal, masked_s = statistics.median(times["causal"]), statistics.median(times["masked"])
        print(f"{seq_len:>6} {causal:>9.3f} {masked_s:>9.3f} {statistics.median(ratios):>7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--documents", action="store_true", help="memory with document masking on")
    parser.add_argument("--mask-cost", action="store_true", help="time document masking instead of memory")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.mask_cost:
        mask_cost_table(args.seq_lens, args.rounds)
    else:
        memory_table(args.seq_lens, args.cps, documents=args.documents)


if __name__ == "__main__":
    main()
