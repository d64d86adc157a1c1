"""Model FLOPs utilisation of paratrain on one device: fsdp and ddp, bf16 and compile, side by side.

On a GPU it trains the ~1.2B-parameter GPT of examples/gpt_1b.yaml (20 layers, width 2048, 16 heads,
sequence 2048, vocabulary 50304) for --steps steps under each layout, through ``paratrain train`` (one
process, the ThroughputMonitor callback adding FLOP/s to metrics.jsonl), and prints per layout:
tokens/s, TFLOP/s per device and MFU against the GPU's dense bf16 peak (PEAK_FLOPS in
paratrain/callbacks/throughput.py) and against a bf16 matmul measured here (8192^3: what the device
really sustains). Steps before --skip-steps (compile and warm-up) are left out: each figure is the
median over the logged steps after them. The last line is the ddp / fsdp ratio of tokens/s.

Without CUDA (or with --cpu) the same path runs a tiny GPT in fp32 without compile, in seconds, so the
test suite keeps this script working; its MFU is against a measured fp32 matmul only (no CPU peak is
known). Prints, never asserts; GPU results belong in docs/benchmarks.md.

    .venv/bin/python benchmarks/mfu.py                 # GPU: 30 steps of each layout, micro-batch 8
    .venv/bin/python benchmarks/mfu.py --cpu           # the tiny CPU variant
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
THROUGHPUT = "callbacks=[{factory: paratrain.callbacks.throughput:ThroughputMonitor}]"
LAYOUTS = {"fsdp": ["parallel.strategy=fsdp"], "ddp": ["parallel.strategy=ddp"]}


@dataclass(frozen=True)
class Workload:
    config: str
    overrides: tuple[str, ...]
    dtype: torch.dtype
    matmul_size: int


# Micro-batch 8, not gpt_1b.yaml's 4: on one H100 (2026-11-25) 4 gave fsdp 36-44 % MFU over eight runs and
# 8 gave 51 % in both runs (docs/benchmarks.md); --set train.micro_batch_size=4 reruns the smaller one.
GPU = Workload(
    "examples/gpt_1b.yaml",
    (
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "checkpoint.every_steps=0",
        "checkpoint.save_final=false",
    ),
    torch.bfloat16,
    8192,
)
CPU = Workload(
    "examples/quickstart.yaml",
    (
        "model.args={block_size: 64, n_layer: 2, n_head: 4, n_embd: 64}",
        "data.args={block_size: 64, max_chars: 200000}",
        "train.global_batch_size=16",
        "train.micro_batch_size=16",
        "train.device=cpu",
        "precision=fp32",
        "parallel.compile=false",
        "checkpoint.every_steps=0",
        "checkpoint.save_final=false",
    ),
    torch.float32,
    1024,
)


@dataclass(frozen=True)
class Result:
    layout: str
    tokens_per_s: float
    flops_per_s: float
    mfu_peak: float | None
    mfu_matmul: float


def measured_matmul_flops(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 10) -> float:
    """FLOP/s of a square matmul on device: the ceiling dense compute really reaches there."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(2):  # warm-up: kernel selection, clocks
        a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_layout(
    workload: Workload, layout: str, *, steps: int, log_every: int, out_dir: Path, extra: tuple[str, ...] = ()
) -> list[dict]:
    """metrics.jsonl of ``paratrain train`` on one process under the layout (extra overrides last, so they win)."""
    run_dir = out_dir / layout
    command = [
        sys.executable,
        "-m",
        "paratrain.cli",
        "train",
        workload.config,
        *workload.overrides,
        *LAYOUTS[layout],
        f"train.max_steps={steps}",
        f"log.every_steps={log_every}",
        f"run.output_dir={run_dir}",
        THROUGHPUT,
        *extra,
    ]
    finished = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if finished.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {finished.returncode}:\n{finished.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarize(layout: str, records: list[dict], *, skip_steps: int, ceiling: float) -> Result:
    kept = [record for record in records if record["step"] > skip_steps and "flops_per_s_per_device" in record]
    if not kept:
        raise RuntimeError(f"{layout}: no logged step after step {skip_steps}; raise --steps")
    flops = statistics.median(record["flops_per_s_per_device"] for record in kept)
    mfus = [record["mfu"] for record in kept if "mfu" in record]
    return Result(
        layout=layout,
        tokens_per_s=statistics.median(record["tokens_per_s"] for record in kept),
        flops_per_s=flops,
        mfu_peak=statistics.median(mfus) if mfus else None,
        mfu_matmul=flops / ceiling,
    )


def report(results: list[Result], *, device_label: str, ceiling: float, dtype: torch.dtype) -> str:
    lines = [
        f"device: {device_label}; torch {torch.__version__}; measured {dtype} matmul: {ceiling / 1e12:.2f} TFLOP/s"
    ]
    for result in results:
        peak = "n/a (no known peak)" if result.mfu_peak is None else f"{result.mfu_peak:.1%}"
        lines.append(
            f"{result.layout}: {result.tokens_per_s:,.0f} tokens/s, {result.flops_per_s / 1e12:.3f} TFLOP/s per device, "
            f"MFU vs peak {peak}, vs measured matmul {result.mfu_matmul:.1%}"
        )
    by_layout = {result.layout: result for result in results}
    if {"ddp", "fsdp"} <= by_layout.keys():
        ratio = by_layout["ddp"].tokens_per_s / by_layout["fsdp"].tokens_per_s
        lines.append(f"ddp / fsdp tokens/s: {ratio:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the tiny CPU variant even where CUDA is present")
    parser.add_argument("--steps", type=int, help="optimizer steps per layout (default: 30 on GPU, 12 on CPU)")
    parser.add_argument("--skip-steps", type=int, help="warm-up steps left out (default: 10 on GPU, 4 on CPU)")
    parser.add_argument("--layouts", default="fsdp,ddp", help="comma-separated, from: fsdp, ddp")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every layout, after the workload's (e.g. train.micro_batch_size=8); repeatable",
    )
    parser.add_argument("--out-dir", type=Path, help="where the runs write (default: a temporary directory)")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.cpu
    workload = GPU if on_gpu else CPU
    steps = args.steps or (30 if on_gpu else 12)
    skip = args.skip_steps if args.skip_steps is not None else (10 if on_gpu else 4)
    device = torch.device("cuda" if on_gpu else "cpu")
    ceiling = measured_matmul_flops(device, workload.dtype, workload.matmul_size)
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.out_dir or Path(tmp)
        results = [
            summarize(
                layout,
                train_layout(workload, layout, steps=steps, log_every=2, out_dir=out_dir, extra=tuple(args.set)),
                skip_steps=skip,
                ceiling=ceiling,
            )
            for layout in args.layouts.split(",")
        ]
    label = torch.cuda.get_device_name(device) if on_gpu else "cpu (tiny GPT, fp32, no compile)"
    if args.set:
        label += f"; overrides: {' '.join(args.set)}"
    print(report(results, device_label=label, ceiling=ceiling, dtype=workload.dtype))
    return results


if __name__ == "__main__":
    main()
