"""Token data: how fast paratrain tokenizes a corpus, and how long training steps wait for data.

1. Tokenization throughput. A corpus of the Python standard library's sources (one JSON line per
   module, ``--max-mb`` of text) and a byte-level BPE tokenizer trained on it locally. *own*: the
   tokenizer's own ``encode_batch`` over all texts at once, already in memory (the upper bound).
   *paratrain*: ``build_token_array`` into a fresh cache directory: reading the JSON lines, encoding in
   batches, writing the uint16 array and its BLAKE2 digest, checking nothing is reused. Rounds alternate
   the order; the median of each is printed as tokens/s and their ratio.
2. Loader stall. ``examples/llama_text.yaml`` (fsdp on 2 processes) trained ``--steps`` steps at
   data.num_workers 0 and 2, one after the other; ``data_wait_fraction`` is the share of rank 0's step
   time spent in ``next()`` on the loader, logged per window by the trainer. The first window (step 1:
   process and worker start-up) is left out. Target: < 2 %.

This prints, it never asserts; results belong in docs/benchmarks.md.

    .venv/bin/python benchmarks/data_loading.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from paratrain.data.corpus import resolve_files  # noqa: E402
from paratrain.data.stdlib_corpus import train_tokenizer  # noqa: E402
from paratrain.data.token_cache import build_token_array  # noqa: E402
from paratrain.data.tokenizer import load_tokenizer  # noqa: E402

TARGET_STALL = 0.02


def write_source_corpus(path: Path, max_bytes: int) -> list[str]:
    texts, size = [], 0
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = source.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return texts


def tokenization(directory: Path, *, max_mb: float, rounds: int) -> None:
    corpus = directory / "corpus.jsonl"
    texts = write_source_corpus(corpus, int(max_mb * 1e6))
    train_tokenizer(corpus, directory / "tokenizer.json", vocab_size=4096)
    loaded = load_tokenizer(directory / "tokenizer.json")
    own, ours, tokens = [], [], 0
    for round_ in range(rounds):
        for which in ("own", "paratrain") if round_ % 2 == 0 else ("paratrain", "own"):
            started = time.perf_counter()
            if which == "own":
                tokens = sum(len(e.ids) + 1 for e in loaded.tokenizer.encode_batch(texts, add_special_tokens=False))
                own.append(time.perf_counter() - started)
            else:
                array = build_token_array(
                    resolve_files(str(corpus)),
                    loaded,
                    text_field="text",
                    cache_dir=directory / f"cache{round_}",
                    local_rank=0,
                )
                ours.append(time.perf_counter() - started)
    mb = sum(map(len, texts)) / 1e6
    own_rate, our_rate = tokens / statistics.median(own), array.num_tokens / statistics.median(ours)
    print(f"corpus: {len(texts)} documents, {mb:.1f} MB, {array.num_tokens} tokens (with one EOS each)")
    print(f"  tokenizer encode_batch (in memory): {own_rate:,.0f} tokens/s  (median of {rounds})")
    print(f"  paratrain build_token_array:        {our_rate:,.0f} tokens/s  (read + encode + write + digest)")
    print(f"  ratio paratrain / encode_batch: {our_rate / own_rate:.2f}")


def loader_stall(directory: Path, *, steps: int) -> None:
    data = directory / "example"
    subprocess.run([sys.executable, "-m", "paratrain.data.stdlib_corpus", str(data)], check=True, capture_output=True)
    for workers in (0, 2):
        output = directory / f"run-{workers}"
        overrides = [
            f"run.output_dir={output}",
            f"train.max_steps={steps}",
            f"data.num_workers={workers}",
            f"data.args.files={data}/corpus.jsonl",
            f"data.args.tokenizer={data}/tokenizer.json",
            f"data.args.cache_dir={data}/cache",
            "eval.factory=null",
            "checkpoint.every_steps=0",
            "checkpoint.save_final=false",
            "log.every_steps=10",
        ]
        command = [REPO / ".venv/bin/paratrain", "train", "examples/llama_text.yaml", "--nproc-per-node", "2"]
        subprocess.run([str(part) for part in command] + overrides, check=True, capture_output=True, cwd=REPO)
        records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
        windows = [r for r in records if r["step"] > 1]
        stall = sum(r["data_wait_fraction"] * r["step_time_s"] * 10 for r in windows) / sum(
            r["step_time_s"] * 10 for r in windows
        )
        step_ms = statistics.median(r["step_time_s"] for r in windows) * 1e3
        print(
            f"  data.num_workers={workers}: waiting for data {stall:.2%} of step time (median step {step_ms:.0f} ms, "
            f"steps 2-{steps}) -> {'within' if stall < TARGET_STALL else 'ABOVE'} the {TARGET_STALL:.0%} target"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-mb", type=float, default=2.0, help="corpus size for the tokenization part")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=31, help="training steps per worker count")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tokenization(Path(tmp), max_mb=args.max_mb, rounds=args.rounds)
        print("loader stall, examples/llama_text.yaml, fsdp on 2 processes:")
        loader_stall(Path(tmp), steps=args.steps)


if __name__ == "__main__":
    main()
