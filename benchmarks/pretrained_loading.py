"""Loading pretrained weights: paratrain ``model.pretrained`` under fsdp x4 against one process
calling transformers' ``from_pretrained``, measured in one invocation.

A Llama is saved with ``save_pretrained`` (sharded, with an index) into a temporary directory. Then:
- reference: a fresh process imports transformers, records its peak RSS, calls
  ``AutoModelForCausalLM.from_pretrained`` and records the peak again;
- paratrain: 4 ranks (paratrain's launcher, gloo, CPU) each record their peak RSS after imports,
  build the Trainer of a config with ``model.pretrained`` and ``parallel.strategy=fsdp`` (build on
  meta, lay out, read each tensor and keep the rank's slice), and record the peak again.
The figure is the peak's growth during loading (ru_maxrss after minus VmRSS before). Target per rank:
model bytes / 4 + the largest tensor + 10 %. Each rank also reports the loading step alone: the real
``materialize`` call the Trainer makes (allocate this rank's shards, read each tensor, keep the slice),
its peak taken from VmHWM after resetting it (``/proc/self/clear_refs``) on entry. The whole-Trainer
figure also holds what loading does not do: the model's code imported on first build, the dataset,
FSDP's set-up. Prints, never asserts; results in docs/benchmarks.md.

    .venv/bin/python benchmarks/pretrained_loading.py --hidden 512 --layers 8
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
NPROC = 4


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def current_rss_bytes() -> int:
    """VmRSS now: the baseline, since the peak may already be higher from importing."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def reset_peak_rss() -> None:
    """Starts VmHWM (the peak resident set) again from the current VmRSS (Linux, see proc(5))."""
    Path("/proc/self/clear_refs").write_text("5")


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure_materialize(rows: list[dict]) -> None:
    """Wraps the materialize the Trainer calls so that each call records its own peak growth."""
    import paratrain.layout.flat

    real = paratrain.layout.flat.materialize

    def measured(*args, **kwargs):
        reset_peak_rss()
        before, start = status_bytes("VmRSS"), time.perf_counter()
        real(*args, **kwargs)
        rows.append({"seconds": time.perf_counter() - start, "peak_growth": status_bytes("VmHWM") - before})

    paratrain.layout.flat.materialize = measured


def save_model(directory: Path, *, hidden: int, layers: int) -> dict:
    import torch

    from paratrain.models.hf import causal_lm

    torch.manual_seed(0)
    model = causal_lm(
        model_type="llama",
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    model.save_pretrained(directory, max_shard_size="20MB")
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    return {"model_bytes": sum(sizes), "largest_tensor_bytes": max(sizes)}


def reference_worker(directory: str) -> None:
    import transformers

    before, start = current_rss_bytes(), time.perf_counter()
    transformers.AutoModelForCausalLM.from_pretrained(directory)
    print(json.dumps({"seconds": time.perf_counter() - start, "peak_growth": peak_rss_bytes() - before}))


def paratrain_worker(directory: str, out: str) -> None:
    import torch.distributed as dist

    from paratrain.config.loading import load_config
    from paratrain.training.trainer import Trainer

    dist.init_process_group("gloo")
    overrides = [
        f"model.pretrained={directory}",
        "parallel.strategy=fsdp",
        f"run.output_dir={out}/run",
        "train.global_batch_size=4",
        "train.micro_batch_size=1",
        "data.args={block_size: 64, max_chars: 20000}",
    ]
    config = load_config(None, overrides)
    loads: list[dict] = []
    measure_materialize(loads)
    dist.barrier()
    before, start = current_rss_bytes(), time.perf_counter()
    trainer = Trainer(config)
    dist.barrier()
    seconds = time.perf_counter() - start
    row = {"rank": dist.get_rank(), "seconds": seconds, "peak_growth": peak_rss_bytes() - before, "loads": loads}
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(row))
    trainer.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory, out = Path(tmp, "model"), Path(tmp, "out")
        out.mkdir()
        sizes = save_model(directory, hidden=args.hidden, layers=args.layers)
        script = [sys.executable, str(Path(__file__).resolve())]
        reference = json.loads(
            subprocess.run(
                [*script, "reference", str(directory)], check=True, capture_output=True, text=True, cwd=REPO_ROOT
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        launcher = [sys.executable, "-m", "tests.launch_workers", str(NPROC), "benchmarks.pretrained_loading"]
        subprocess.run(
            [*launcher, "paratrain", str(directory), str(out)],
            check=True,
            cwd=REPO_ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        ranks = [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(NPROC)]
    mib = 1 << 20
    target = (sizes["model_bytes"] / NPROC + sizes["largest_tensor_bytes"]) * 1.10
    print(
        f"model {sizes['model_bytes'] / mib:.1f} MiB fp32, largest tensor {sizes['largest_tensor_bytes'] / mib:.1f} MiB"
    )
    print(
        f"from_pretrained, 1 process: peak RSS growth {reference['peak_growth'] / mib:.1f} MiB, {reference['seconds']:.2f} s"
    )
    for row in ranks:
        print(
            f"paratrain fsdp x{NPROC} rank {row['rank']}: peak RSS growth {row['peak_growth'] / mib:.1f} MiB, {row['seconds']:.2f} s (Trainer built)"
        )
        for load in row["loads"]:
            print(
                f"    loading alone (materialize): peak RSS growth {load['peak_growth'] / mib:.1f} MiB, {load['seconds']:.2f} s"
            )
    worst = max(row["peak_growth"] for row in ranks)
    worst_load = max(load["peak_growth"] for row in ranks for load in row["loads"])
    print(
        f"target per rank (model/{NPROC} + largest + 10%): {target / mib:.1f} MiB; worst rank {worst / mib:.1f} MiB "
        f"= {worst / target:.2f} x target (Trainer built), loading alone {worst_load / mib:.1f} MiB = "
        f"{worst_load / target:.2f} x target; Trainer vs from_pretrained {worst / reference['peak_growth']:.2f} x"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "reference":
        reference_worker(sys.argv[2])
    elif len(sys.argv) > 1 and sys.argv[1] == "paratrain":
        paratrain_worker(sys.argv[2], sys.argv[3])
    else:
        main()
