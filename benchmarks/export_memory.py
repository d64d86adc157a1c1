"""Peak memory and time of ``paratrain export``, this checkout against an earlier revision, side by side.

Each checkout trains a transformers Llama built from its config (about 0.2 B parameters by default) for one
step, `paratrain train` with checkpoint.save_final=true: a full fine-tune and a LoRA run, each written in
its own checkpoint format (an earlier revision's cannot read checksums newer than it; this checkout writes
the model's entries in files of their own, the earlier one model and optimizer entries in the same files).
Each checkout then exports its own checkpoints, every export a process of its own whose peak RSS GNU time
reports (``/usr/bin/time -f %M``) and whose wall time is measured around it:

- adapter: ``export LORA_RUN --hf DIR`` (peft's adapter directory)
- merge: ``export LORA_RUN --hf DIR --merge``
- full --hf: ``export FULL_RUN --hf DIR``
- full --out: ``export FULL_RUN --out FILE``

"runtime" is the peak RSS of a process that imports what that export imports and exports nothing; the last
column is this checkout's (peak - runtime) over the largest tensor's bytes. The two checkouts' outputs must
hold the same tensor names and shapes (their values differ where the revisions initialise differently).
Each export runs ``--repeats`` times per checkout, in turn; the table shows the fastest times and the
highest peak. Run from the repository root:

    python benchmarks/export_memory.py --before 7d3e201
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
TIME = "/usr/bin/time"  # GNU time: the child's own peak RSS


@dataclass(frozen=True)
class Measured:
    seconds: float  # wall
    cpu_seconds: float  # user + system: less at the mercy of other work on the machine than the wall time
    peak_mb: float


def main() -> None:
    args = parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="paratrain-export-memory-"))
    sides = {"before": checkout(args.before, work / "before-src"), "after": ROOT}
    llama = llama_args(args)
    largest_mb = args.vocab * args.hidden * 4 / 2**20
    print(f"Llama: {parameter_count(args) / 1e9:.3f} B parameters, largest tensor {largest_mb:.0f} MB; work in {work}")
    # Each checkout exports the checkpoints it wrote: an earlier revision cannot verify a newer format.
    runs = {
        side: {kind: train(source, work / "runs" / side / kind, llama, lora=lora) for kind, lora in KINDS.items()}
        for side, source in sides.items()
    }
    print(
        f"{'export':<12} {'wall s before':>13} {'after':>6} {'ratio':>6} {'cpu s before':>12} {'after':>6} {'ratio':>6} "
        f"{'peak MB before':>14} {'after':>6} {'ratio':>6} {'runtime MB':>10} {'(after-runtime)/largest':>23}"
    )
    for name, (kind, target, imports) in EXPORTS.items():
        measured: dict[str, list[Measured]] = {side: [] for side in sides}
        outputs = {side: work / "exports" / side / name.replace(" ", "_") for side in sides}
        for _ in range(args.repeats):  # the two checkouts in turn: both see the same page cache and load
            for side, source in sides.items():
                outputs[side].mkdir(parents=True, exist_ok=True)
                command = ["-m", "paratrain.cli", "export", str(runs[side][kind])]
                measured[side].append(measure(source, command + [part.format(out=outputs[side]) for part in target]))
        before, after = best(measured["before"]), best(measured["after"])
        runtime = measure(ROOT, ["-c", f"import paratrain.cli, paratrain.tools.export, {imports}"]).peak_mb
        same = "same shapes" if same_shapes(outputs["before"], outputs["after"]) else "SHAPES DIFFER"
        print(
            f"{name:<12} {before.seconds:13.1f} {after.seconds:6.1f} {before.seconds / after.seconds:6.2f} "
            f"{before.cpu_seconds:12.1f} {after.cpu_seconds:6.1f} {before.cpu_seconds / after.cpu_seconds:6.2f} "
            f"{before.peak_mb:14.0f} {after.peak_mb:6.0f} {before.peak_mb / after.peak_mb:6.2f} {runtime:10.0f} "
            f"{(after.peak_mb - runtime) / largest_mb:23.2f}  {same}",
            flush=True,
        )


# name: (run, arguments after the checkpoint, what the export imports besides paratrain's CLI and export)
EXPORTS = {
    "adapter": ("lora", ["--hf", "{out}"], "peft, transformers.models.llama.modeling_llama"),
    "merge": ("lora", ["--hf", "{out}", "--merge"], "peft, transformers.models.llama.modeling_llama"),
    "full --hf": ("full", ["--hf", "{out}"], "transformers.models.llama.modeling_llama"),
    "full --out": ("full", ["--out", "{out}/model.safetensors"], "torch.distributed.checkpoint"),
}


LORA = {
    "r": 8,
    "alpha": 16,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
KINDS = {"full": None, "lora": LORA}  # the runs each checkout trains: a full fine-tune and LoRA


def best(runs: list[Measured]) -> Measured:
    """The fastest wall and CPU times of the repeats (the least disturbed by other work), and the highest peak."""
    return Measured(
        seconds=min(run.seconds for run in runs),
        cpu_seconds=min(run.cpu_seconds for run in runs),
        peak_mb=max(run.peak_mb for run in runs),
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--before", default="7d3e201", help="git revision to compare with (default: the last before streamed exports)"
    )
    parser.add_argument("--work", help="directory for the checkouts, runs and exports (default: a new temp dir)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each export per checkout (default 3)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    return parser.parse_args()


def llama_args(args: argparse.Namespace) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "max_position_embeddings": 128,
    }


def parameter_count(args: argparse.Namespace) -> int:
    head = args.hidden // 16
    attention = 2 * args.hidden * args.hidden + 2 * args.hidden * 8 * head
    layer = attention + 3 * args.hidden * args.intermediate + 2 * args.hidden
    return args.layers * layer + 2 * args.vocab * args.hidden + args.hidden


def checkout(revision: str, into: Path) -> Path:
    """The revision's files (git archive), for running it with PYTHONPATH pointing there."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def train(source: Path, output_dir: Path, llama: dict, *, lora: dict | None) -> Path:
    """One optimizer step and the final checkpoint; returns the run directory (export finds its newest checkpoint).
    A run already in ``--work`` is kept: a rerun measures the exports alone."""
    if (output_dir / "checkpoints").is_dir():
        return output_dir
    config = {
        "run": {"output_dir": str(output_dir)},
        "train": {"max_steps": 1, "global_batch_size": 2, "micro_batch_size": 2, "seed": 0},
        "optim": {"lr": 1e-4},
        "parallel": {"strategy": "single"},
        "checkpoint": {"save_final": True, "keep_last": 1},
        "log": {"every_steps": 1},
        "model": {"factory": "paratrain.models.hf:causal_lm", "args": llama, "lora": lora},
        "data": {"factory": "paratrain.data.text:build_char_dataset", "args": {"block_size": 64}},
        "loss": {"factory": "paratrain.losses:cross_entropy"},
    }
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    path = output_dir.parent / f"{output_dir.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run(source, ["-m", "paratrain.cli", "train", str(path)])
    if result.returncode != 0:
        sys.exit(f"training with {source} failed:\n{result.stderr[-3000:]}")
    return output_dir


def run(source: Path, argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(source)}
    return subprocess.run([sys.executable, *argv], cwd=source, env=env, capture_output=True, text=True)


def measure(source: Path, argv: list[str]) -> Measured:
    """Wall and CPU time and peak RSS of ``python argv`` run with ``source``. The peak is GNU time's (%M): wait4's
    ru_maxrss of a child of this process would include this process's own RSS, which Linux carries into the
    child's high-water mark through fork and exec."""
    env = {**os.environ, "PYTHONPATH": str(source)}
    with tempfile.NamedTemporaryFile("r") as peak:
        started = time.perf_counter()
        result = subprocess.run(
            [TIME, "-f", "%M %U %S", "-o", peak.name, sys.executable, *argv],
            cwd=source,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        seconds = time.perf_counter() - started
        if result.returncode != 0:
            sys.exit(f"{argv} with {source} failed:\n{result.stderr[-3000:]}")
        kib, user, system = peak.read().split()[-3:]
        return Measured(seconds=seconds, cpu_seconds=float(user) + float(system), peak_mb=int(kib) / 1024)


def same_shapes(first: Path, second: Path) -> bool:
    one, other = tensors_in(first), tensors_in(second)
    return one.keys() == other.keys() and all(one[name].shape == other[name].shape for name in one)


def tensors_in(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


if __name__ == "__main__":
    main()
