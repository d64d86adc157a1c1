"""float8 training and activation checkpointing on one GPU, on the 1.5B Llama of benchmarks/vs_torchtitan.py.

Every run is paratrain's half of that comparison (the transformers Llama at the Llama 3.2 1B shape, sequence
2048, micro-batch 8, bf16, torch.compile, one process, the same corpus and tokenizer), as layout ``single``
(fp32 weights, autocast) unless --layout fsdp (FSDP2 at world size 1, bf16 parameters: the float8
all-gather's path), with one change each:

  bf16                 nothing: the reference (and the "none" row of the checkpointing table)
  float8-tensorwise    parallel.float8 with tensorwise scaling
  float8-rowwise       parallel.float8 with rowwise scaling
  selective, full      parallel.activation_checkpointing

Two tables: bf16 against float8, tokens/s (median of the steps after --skip-steps), peak reserved memory and
the loss over --loss-steps steps (every 50th step's, and the largest relative gap to bf16 over the last
half) on 24 MB of the standard library's source (--source-mb; the docstrings alone, 100k tokens, are memorised
within 300 steps, which is not what the loss comparison is for); then none / selective / full checkpointing,
peak reserved memory against tokens/s (--steps each; "none" is the bf16 run). ``--shape wide`` trains Llama 3
8B's layers instead (width 4096, 6 of them): float8 gains more as matmuls grow (1.13 x at width 2048 on an H100). float8 needs a GPU of compute capability 8.9 (H100, H200) and torchao. Prints,
never asserts; results go in docs/benchmarks.md.

    python3 benchmarks/float8_checkpointing.py --runs bf16,float8-tensorwise      # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # vs_torchtitan beside it, also when a test loads this

import vs_torchtitan as titan  # noqa: E402 - after its folder is on the path

LOSS_RUNS = ("bf16", "float8-tensorwise", "float8-rowwise")  # trained --loss-steps steps
CHANGES = {
    "bf16": [],
    "float8-tensorwise": ["parallel.float8.enabled=true", "parallel.float8.scaling=tensorwise"],
    "float8-rowwise": ["parallel.float8.enabled=true", "parallel.float8.scaling=rowwise"],
    "selective": ["parallel.activation_checkpointing=selective"],
    "full": ["parallel.activation_checkpointing=full"],
}
LOSS_EVERY = 50
# model.args of each --shape: the 1.5B of vs_torchtitan, or Llama 3 8B's layer shape with fewer layers.
SHAPES = {
    "1.5b": titan.LLAMA_ARGS,
    "wide": titan.LLAMA_ARGS.replace("hidden_size: 2048", "hidden_size: 4096")
    .replace("intermediate_size: 8192", "intermediate_size: 14336")
    .replace("num_hidden_layers: 16", "num_hidden_layers: 6"),
}


@dataclass(frozen=True)
class Run:
    name: str
    tokens_per_s: float
    peak_reserved_gib: float
    losses: dict[int, float]


def run_command(
    run: str,
    run_dir: Path,
    corpus: Path,
    tokenizer: Path,
    *,
    layout: str,
    steps: int,
    micro_batch: int,
    shape: str = "1.5b",
) -> list[str]:
    """vs_torchtitan's paratrain command for ``layout``, then the shape and this run's change (later overrides
    win). The throughput callback's FLOPs stay the 1.5B's: this script reads tokens/s, not MFU."""
    command = titan.paratrain_command(run_dir, corpus, tokenizer, layout=layout, steps=steps, micro_batch=micro_batch)
    shape_override = [] if shape == "1.5b" else [f"model.args={SHAPES[shape]}"]
    return [*command, *shape_override, *CHANGES[run]]


def steps_of(run: str, args: argparse.Namespace) -> int:
    return args.loss_steps if run in LOSS_RUNS else args.steps


def train(run: str, work: Path, corpus: Path, tokenizer: Path, args: argparse.Namespace) -> Path:
    run_dir = work / run
    command = run_command(
        run,
        run_dir,
        corpus,
        tokenizer,
        layout=args.layout,
        steps=steps_of(run, args),
        micro_batch=args.micro_batch,
        shape=args.shape,
    )
    print(f"{run}:", " ".join(command), flush=True)
    log = work / f"{run}.log"
    with log.open("w") as out:
        finished = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=titan.REPO_ROOT)
    if finished.returncode != 0:
        raise RuntimeError(f"{run} exited with {finished.returncode}:\n{log.read_text()[-4000:]}")
    return run_dir / "metrics.jsonl"


def read_run(run: str, metrics: Path, *, skip_steps: int) -> Run:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    timed = [
        record["tokens_per_s"] for record in records if record.get("step", 0) > skip_steps and "tokens_per_s" in record
    ]
    if not timed:
        raise RuntimeError(f"no step after {skip_steps} in {metrics}")
    peak_mb = max(record.get("mem_peak_reserved_mb_max", 0) for record in records)
    losses = {record["step"]: record["loss"] for record in records if "loss" in record}
    return Run(run, statistics.median(timed), peak_mb / 1024, losses)


def loss_gap(run: Run, reference: Run) -> float:
    """The largest relative gap of ``run``'s loss to ``reference``'s over the last half of the steps both
    logged (the first steps' losses fall too fast for a gap to mean much)."""
    steps = sorted(run.losses.keys() & reference.losses.keys())
    late = steps[len(steps) // 2 :]
    return max(abs(run.losses[s] - reference.losses[s]) / reference.losses[s] for s in late)


def float8_lines(runs: dict[str, Run]) -> list[str]:
    bf16 = runs.get("bf16")
    lines = []
    for name in LOSS_RUNS:
        if name not in runs:
            continue
        run = runs[name]
        every = " ".join(f"{step}:{run.losses[step]:.3f}" for step in sorted(run.losses) if step % LOSS_EVERY == 0)
        line = f"{name}: {run.tokens_per_s:,.0f} tokens/s, peak reserved {run.peak_reserved_gib:.1f} GiB; loss {every}"
        if bf16 is not None and name != "bf16":
            line += (
                f"; tokens/s / bf16 {run.tokens_per_s / bf16.tokens_per_s:.3f}, "
                f"largest loss gap to bf16 (last half) {loss_gap(run, bf16):.2%}"
            )
        lines.append(line)
    return lines


def checkpointing_lines(runs: dict[str, Run]) -> list[str]:
    rows = {"none": runs.get("bf16"), "selective": runs.get("selective"), "full": runs.get("full")}
    none = rows["none"]
    lines = []
    for mode, run in rows.items():
        if run is None:
            continue
        line = f"checkpointing {mode}: peak reserved {run.peak_reserved_gib:.1f} GiB, {run.tokens_per_s:,.0f} tokens/s"
        if none is not None and mode != "none":
            line += (
                f" (memory / none {run.peak_reserved_gib / none.peak_reserved_gib:.2f}, "
                f"tokens/s / none {run.tokens_per_s / none.tokens_per_s:.3f})"
            )
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="bf16,float8-tensorwise,selective,full", help="comma-separated, in order")
    parser.add_argument("--layout", choices=sorted(titan.PARATRAIN_LAYOUTS), default="single")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.5b", help="the model (see above)")
    parser.add_argument("--loss-steps", type=int, default=300, help="steps of bf16 and the float8 runs")
    parser.add_argument("--steps", type=int, default=30, help="steps of the checkpointing runs")
    parser.add_argument("--skip-steps", type=int, default=10, help="compile and warm-up steps left out of tokens/s")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--out-dir", type=Path, help="keep the runs and logs here (default: a temporary folder)")
    parser.add_argument(
        "--source-mb",
        type=float,
        default=24,
        help="corpus: this many MB of the standard library's source (0: docstrings)",
    )
    args = parser.parse_args(argv)
    unknown = set(args.runs.split(",")) - CHANGES.keys()
    if unknown:
        parser.error(f"--runs: unknown {sorted(unknown)}; choose from {sorted(CHANGES)}")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.out_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        corpus, tokenizer = titan.make_data(work / "data", source_mb=args.source_mb)
        for name in args.runs.split(","):
            try:
                runs[name] = read_run(name, train(name, work, corpus, tokenizer, args), skip_steps=args.skip_steps)
            except RuntimeError as error:
                print(f"{name} FAILED: {error}", flush=True)
    device, _ = titan.gpu_peak_bf16()
    print(
        f"device: {device}; shape {args.shape}, layout {args.layout}, sequence {titan.SEQUENCE}, micro-batch {args.micro_batch}"
    )
    for line in float8_lines(runs) + checkpointing_lines(runs):
        print(line)


if __name__ == "__main__":
    main()
