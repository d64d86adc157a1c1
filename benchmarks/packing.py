"""Packed chat samples against padded ones, and attention within documents against plain causal attention.

    .venv/bin/python benchmarks/packing.py [--samples 600] [--seq-len 2048] [--steps 6]

1. **Fine-tuning throughput.** A chat set with a realistic spread of lengths (log-normal, median ~300 tokens,
   a tail past 2k; the last 40 % of each sample, its reply, are targets) at ``seq_len``, trained as
   (a) one sample per padded row (``pack: false``) and (b) packed rows (``pack: true``), by a small
   transformers Llama in one process, the same rows per micro-batch (so the same activation memory). It
   prints target tokens per second of each, their ratio (goal >= 3), and the share of padding in each.
2. **Attention within documents.** The same model on full rows of a corpus (documents ending with EOS,
   log-normal lengths), with attention over each whole row (causal) and within each document
   (``document_mask``), forward and backward: seconds per step and their ratio (goal <= 1.1 at 2k).

Both alternate their two sides step by step, so a busy machine slows both alike; one intra-op thread.
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


def model_pair(seq_len: int):
    """Two identical small Llamas: one with paratrain's attention within documents installed, one plain."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(
            causal_lm(
                model_type="llama",
                vocab_size=VOCAB,
                hidden_size=256,
                intermediate_size=512,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=seq_len,
            )  # fmt: skip
        )
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
    loss_fn = cross_entropy()
    started = time.perf_counter()
    if sharding is not None:
        inputs, targets = sharding.shard(inputs, targets)
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    if sharding is not None:
        sharding.release()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def fine_tuning(args) -> None:
    rng = random.Random(0)
    samples = chat_samples(args.samples, args.seq_len, rng)
    padded = ChatSamples(samples, seq_len=args.seq_len, pad_id=0, vocab_size=VOCAB)
    packed = PackedSamples(samples, seq_len=args.seq_len, pad_id=0, vocab_size=VOCAB)
    packed_model, padded_model = model_pair(args.seq_len)
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
    masked_model, causal_model = model_pair(args.seq_len)
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
    args = parser.parse_args()
    torch.set_num_threads(1)
    fine_tuning(args)
    document_attention_cost(args)


if __name__ == "__main__":
    main()
