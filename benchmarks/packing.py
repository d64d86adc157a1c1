"""Packed chat samples against padded ones, and attention within documents against plain causal attention.

    .venv/bin/python benchmarks/packing.py [--samples 600] [--seq-len 2048] [--steps 6]
    python3 benchmarks/packing.py --device cuda --width 1024 --layers 4 --rows 4 --steps 10 --samples 300   # on a GPU (bf16)

1. **Fine-tuning throughput.** A chat set with a realistic spread of lengths (log-normal, median ~300 tokens,
   a tail past 2k; the last 40 % of each sample, its reply, are targets) at ``seq_len``, trained as
   (a) one sample per padded row (``pack: false``) and (b) packed rows (``pack: true``), by a small
   transformers Llama in one process, the same rows per micro-batch (so the same activation memory). It
   prints target tokens per second of each, their ratio (goal >= 3), and the share of padding in each.
2. **Attention within documents.** The same model on full rows of a corpus (documents ending with EOS,
   log-normal lengths), with attention over each whole row (causal) and within each document
   (``document_mask``), forward and backward: seconds per step and their ratio (goal <= 1.1 at 2k).

Both alternate their two sides step by step, so a busy machine slows both alike; one intra-op thread on
CPU. On ``--device cuda`` the models run under bf16 autocast and each step is timed to its last kernel.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from paratrain.data.chat import ChatSample, ChatSamples
from paratrain.data.packing import PackedSamples
from paratrain.losses import IGNORE_INDEX, cross_entropy
from paratrain.models.attention_hooks import install_sequence_functions
from paratrain.models.hf import causal_lm
from paratrain.parallel.documents import EndToken, MarkedStarts
from paratrain.parallel.sequence_sharding import SequenceSharding

VOCAB = 1024
EOS = 1


def model_pair(args):
    """Two identical Llamas (``--width``, ``--layers``; 64-wide heads) on ``--device``: one with paratrain's
    attention within documents installed, one plain."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = causal_lm(
            model_type="llama",
            vocab_size=VOCAB,
            hidden_size=args.width,
            intermediate_size=2 * args.width,
            num_hidden_layers=args.layers,
            num_attention_heads=args.width // 64,
            num_key_value_heads=max(1, args.width // 128),
            max_position_embeddings=args.seq_len,
        )
        models.append(model.to(args.device))
    return models


def chat_samples(count: int, seq_len: int, rng: random.Random) -> list[ChatSample]:
    samples = []
    for _ in range(count):
        length = min(seq_len + 1, max(16, int(rng.lognormvariate(5.7, 0.8))))  # median e^5.7 ~ 300
        tokens = [rng.randrange(2, VOCAB) for _ in range(length)]
        reply = int(length * 0.6)
        samples.append(ChatSample(tokens, [IGNORE_INDEX] * reply + tokens[reply:]))
    return samples


def step_seconds(model, sharding, inputs, targets) -> float:
    """Seconds of one forward and backward (bf16 autocast on CUDA), to its last kernel."""
    loss_fn = cross_entropy()
    device = next(model.parameters()).device
    inputs, targets = inputs.to(device), targets.to(device)
    synchronize(device)
    started = time.perf_counter()
    if sharding is not None:
        inputs, targets = sharding.shard(inputs, targets)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = loss_fn(model(inputs), targets)
    loss.backward()
    if sharding is not None:
        sharding.release()
    model.zero_grad(set_to_none=True)
    synchronize(device)
    return time.perf_counter() - started


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fine_tuning(args) -> None:
    rng = random.Random(0)
    samples = chat_samples(args.samples, args.seq_len, rng)
    padded = ChatSamples(samples, seq_len=args.seq_len, pad_id=0, vocab_size=VOCAB)
    packed = PackedSamples(samples, seq_len=args.seq_len, pad_id=0, vocab_size=VOCAB)
    packed_model, padded_model = model_pair(args)
    sharding = SequenceSharding(cp=1, cp_rank=0, cp_group=None, documents=MarkedStarts())
    install_sequence_functions(packed_model, attention=sharding.attention, positions=sharding.positions)
    rows = args.rows
    rates = {"padded": [], "packed": []}
    for step in range(args.steps):
        for name, data, model, cut in (
            ("padded", padded, padded_model, None),
            ("packed", packed, packed_model, sharding),
        ):
            chosen = [(step * rows + i) % len(data) for i in range(rows)]
            inputs, targets = (torch.stack(parts) for parts in zip(*[data[i] for i in chosen]))
            seconds = step_seconds(model, cut, inputs, targets)
            rates[name].append(int((targets != IGNORE_INDEX).sum()) / seconds)
    real = sum(len(s.tokens) - 1 for s in samples)
    print(f"fine-tuning: {len(samples)} samples, median {statistics.median(len(s.tokens) for s in samples)} tokens, "
          f"longest {max(len(s.tokens) for s in samples)}; seq_len {args.seq_len}, {rows} rows per micro-batch")  # fmt: skip
    for name, data in (("padded", padded), ("packed", packed)):
        padding = 1 - real / (len(data) * args.seq_len)
        median = statistics.median(rates[name][1:])
        print(f"  {name}: {len(data):5d} rows, padding {100 * padding:5.1f} %, {median:9.0f} target tokens/s")
    print(
        f"  packed / padded target tokens/s: {statistics.median(rates['packed'][1:]) / statistics.median(rates['padded'][1:]):.2f}"
    )


def document_rows(count: int, seq_len: int, rng: random.Random) -> torch.Tensor:
    rows = []
    for _ in range(count):
        row = []
        while len(row) < seq_len:
            length = max(8, int(rng.lognormvariate(5.7, 0.8)))
            row += [rng.randrange(2, VOCAB) for _ in range(length - 1)] + [EOS]
        rows.append(row[:seq_len])
    return torch.tensor(rows)


def document_attention_cost(args) -> None:
    rng = random.Random(1)
    masked_model, causal_model = model_pair(args)
    sharding = SequenceSharding(cp=1, cp_rank=0, cp_group=None, documents=EndToken(EOS))
    install_sequence_functions(masked_model, attention=sharding.attention, positions=sharding.positions)
    times = {"causal": [], "documents": []}
    for _ in range(args.steps):
        rows = document_rows(args.rows, args.seq_len + 1, rng)
        inputs, targets = rows[:, :-1], rows[:, 1:]
        times["causal"].append(step_seconds(causal_model, None, inputs, targets))
        times["documents"].append(step_seconds(masked_model, sharding, inputs, targets))
    causal, documents = (statistics.median(values[1:]) for values in times.values())
    print(f"attention within documents at {args.seq_len} tokens, {args.rows} rows: causal {causal:.3f} s, "
          f"within documents {documents:.3f} s per step: {documents / causal:.2f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (bf16 autocast)")
    parser.add_argument("--width", type=int, default=256, help="hidden size (heads of 64)")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    print(f"device {args.device}: Llama width {args.width}, {args.layers} layers, vocabulary {VOCAB}")
    fine_tuning(args)
    document_attention_cost(args)


if __name__ == "__main__":
    main()
