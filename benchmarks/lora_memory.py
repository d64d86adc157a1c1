"""Per-rank model-state bytes of LoRA against a full fine-tune of the same transformers model, on the same
layout (fsdp over 2 CPU processes by default).

Model state is parameters + gradients + AdamW state, counted from the tensors each rank holds after a few
steps (benchmarks/fsdp_memory_worker.py, whose runs this reuses with a tiny-but-not-toy Llama and, for LoRA,
``model.lora``). LoRA keeps the frozen base's parameters (sharded by fsdp) and adds adapters; gradients and
optimizer state exist for the adapters only. This prints, it never asserts: results go in docs/benchmarks.md.

    .venv/bin/python benchmarks/lora_memory.py --strategy fsdp --nproc 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_memory import STATE_PARTS, WORKER, RunResult, run_worker  # noqa: E402 - the sibling script's helpers

LLAMA = (
    "{model_type: llama, vocab_size: 128, hidden_size: 512, intermediate_size: 1376, num_hidden_layers: 4, "
    "num_attention_heads: 8, num_key_value_heads: 8, max_position_embeddings: 64}"
)
RUNS = {
    "full fine-tune": [],
    "lora r=8 (attention)": ["model.lora={r: 8, target_modules: [q_proj, k_proj, v_proj, o_proj]}"],
    "lora r=8 (all-linear)": ["model.lora={r: 8}"],
}


def worker_argv(strategy: str, extra: list[str], *, nproc: int, out: Path, run_dir: Path) -> list[str]:
    overrides = ["model.factory=paratrain.models.hf:causal_lm", f"model.args={LLAMA}", *extra]
    flags = ["--strategy", strategy, "--out", str(out), "--output-dir", str(run_dir)]
    flags += ["--warmup-steps", "1", "--timed-steps", "2", "--global-batch-size", "8", "--micro-batch-size", "4"]
    flags += [item for override in overrides for item in ("--override", override)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] + [
        str(WORKER),
        *flags,
    ]


def row(name: str, run: RunResult, full: RunResult) -> str:
    cells = [f"{run.logical_bytes[part] / 2**20:8.2f}" for part in STATE_PARTS]
    ratio = run.total_logical / full.total_logical
    return f"| {name:22} | {' | '.join(cells)} | {run.total_logical / 2**20:8.2f} | {ratio:5.3f} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="fsdp")
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in RUNS.items():
            run_dir = Path(tmp) / name.replace(" ", "_").replace("=", "").replace("(", "").replace(")", "")
            out = run_dir.with_suffix(".json")
            argv = worker_argv(args.strategy, extra, nproc=args.nproc, out=out, run_dir=run_dir)
            results[name] = run_worker(argv, out, timeout_s=600, extra_env={})
    full = results["full fine-tune"]
    print(
        f"model-state MiB per rank (worst rank), {args.strategy} x{args.nproc}, Llama of {full.params_numel:,} params"
    )
    print(f"| run | {' | '.join(STATE_PARTS)} | total | / full |")
    print("|---|" + "---|" * (len(STATE_PARTS) + 2))
    for name, run in results.items():
        print(row(name, run, full))
    return 0


if __name__ == "__main__":
    sys.exit(main())
