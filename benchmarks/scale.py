"""Start-up at the sizes people train: what initialising a model costs each rank, in memory and CPU time, and
how long a launch takes to its first step, for models doubling in size, under single, fsdp x2 and fsdp x4,
along every init path; then what exporting costs.

    .venv/bin/python benchmarks/scale.py [--sizes 0.1 0.2 0.4 0.8] [--layouts 1 2 4] [--paths ...]
        [--baseline TREE] [--out runs/bench-scale]

Init paths: ``gpt`` (paratrain's GPT from scratch: its init_parameter), ``hf`` (a transformers Llama from its
config), ``pretrained`` (the same Llama from a saved directory, ``model.pretrained``), ``resume`` (the Llama
resuming a checkpoint of itself). Each run trains one step (batch 1 per rank, 32 tokens) through paratrain's
Python API (benchmarks/scale_worker.py, under torchrun for several ranks) and reports, per rank, measured
around ``materialize``:

- ``peak``: the rank's resident high-water mark (VmHWM) at the end of initialisation;
- ``ideal``: the runtime (its resident memory just before: torch, the model on meta, the data) + its shard +
  one full tensor (the largest), and ``peak / ideal``;
- ``init CPU``: CPU seconds of the initialisation (one intra-op thread per rank, as torchrun sets), and its
  ratio at fsdp x2 and x4 to ``single``'s;
- ``drawn``: tensors drawn or read by an init source (a resume should draw none);
- ``launch -> step 1``: wall seconds from launching to the end of the first step.

Export paths (one process, ``/usr/bin/time``'s maximum resident set): ``export --hf`` of a full fine-tune's
checkpoint, and of a LoRA run's (its adapter, and ``--merge``). ``--baseline TREE`` runs every case on another
checkout too (e.g. ``git archive`` of an earlier commit), alternating, for ratios measured side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
# hidden, layers, heads, KV heads, feed-forward, of a Llama-shaped model with a 32k vocabulary (untied head).
SHAPES = {
    0.1: (768, 8, 12, 4, 2048),
    0.2: (1024, 12, 16, 4, 2816),
    0.4: (1536, 14, 16, 4, 4096),
    0.8: (2048, 16, 16, 4, 5632),
}
VOCAB = 32000
PATHS = ("gpt", "hf", "pretrained", "resume")


def llama_args(size: float) -> dict:
    hidden, layers, heads, kv, ffn = SHAPES[size]
    return dict(
        model_type="llama", vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=ffn, max_position_embeddings=64,
    )  # fmt: skip


def gpt_args(size: float) -> dict:
    hidden, layers, heads, _, _ = SHAPES[size]
    return dict(vocab_size=VOCAB, block_size=32, n_layer=layers, n_head=heads, n_embd=hidden)


def config(path: str, size: float, nproc: int, output_dir: Path, *, pretrained: Path | None = None) -> dict:
    model = (
        {"factory": "paratrain.models.gpt:build_gpt", "args": gpt_args(size)}
        if path == "gpt"
        else {"factory": "paratrain.models.hf:causal_lm", "args": llama_args(size)}
    )
    if pretrained is not None:
        model = {"pretrained": str(pretrained)}
    return {
        "run": {"name": f"scale-{path}-{size}", "output_dir": str(output_dir)},
        "train": {"max_steps": 1, "global_batch_size": nproc, "micro_batch_size": 1, "seed": 0, "check_memory": False},
        "optim": {"lr": 1e-4, "warmup_steps": 0},
        "log": {"every_steps": 1},
        "checkpoint": {"every_steps": 0, "save_final": False},
        "parallel": {"strategy": "single"} if nproc == 1 else {"strategy": "fsdp", "dp_shard": nproc},
        "model": model,
        "data": {"factory": "paratrain.data.text:build_char_dataset", "args": {"block_size": 32, "max_chars": 20000}},
    }


def run_worker(tree: Path, cfg: dict, nproc: int, work: Path, overrides: list[str] = ()) -> list[dict]:
    """Trains ``cfg`` on ``nproc`` ranks with paratrain from ``tree``; each rank's measurements."""
    shutil.rmtree(work / "result", ignore_errors=True)
    config_file = work / "config.yaml"
    config_file.write_text(yaml.safe_dump(cfg))
    worker = [str(REPO / "benchmarks" / "scale_worker.py"), str(config_file), str(work / "result"), *overrides]
    launcher = (
        [sys.executable, *worker]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *worker]
    )
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "PARATRAIN_SCALE_LAUNCHED": repr(time.time())}
    finished = subprocess.run(launcher, env=env, cwd=tree, capture_output=True, text=True)
    if finished.returncode != 0:
        raise RuntimeError(f"{' '.join(launcher)} failed:\n{finished.stderr[-3000:]}")
    return [json.loads(path.read_text()) for path in sorted((work / "result").glob("rank-*.json"))]


def save_pretrained(tree: Path, size: float, directory: Path) -> None:
    """The Llama of ``size``, built and saved by transformers itself (once per size)."""
    if (directory / "config.json").is_file():
        return
    code = (
        "import json, sys, torch; from paratrain.models.hf import causal_lm; torch.manual_seed(0); "
        f"causal_lm(**json.loads({json.dumps(json.dumps(llama_args(size)))})).save_pretrained({str(directory)!r})"
    )
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(tree)}, check=True)


def measure(tree: Path, path: str, size: float, nproc: int, work: Path) -> list[dict]:
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    if path == "pretrained":
        save_pretrained(tree, size, work.parent / f"pretrained-{size}")
        return run_worker(
            tree, config(path, size, nproc, run_dir, pretrained=work.parent / f"pretrained-{size}"), nproc, work
        )
    if path == "resume":  # a checkpoint of step 1 under the same layout, then the measured resume to step 2
        first = config("hf", size, nproc, run_dir)
        first["checkpoint"] = {"every_steps": 1, "save_final": True}
        run_worker(tree, first, nproc, work)
        # Two steps, not one: the schedule's length changes, which a resume must be told is intended.
        resumed_checkpoint = {**first["checkpoint"], "resume": "auto", "allow_config_change": True}
        resumed = {**first, "train": {**first["train"], "max_steps": 2}, "checkpoint": resumed_checkpoint}
        try:
            return run_worker(tree, resumed, nproc, work)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
    return run_worker(tree, config(path, size, nproc, run_dir), nproc, work)


def summarise(records: list[dict]) -> dict:
    worst = max(records, key=lambda r: r["init_peak_mib"] / (r["runtime_mib"] + r["shard_mib"] + r["largest_mib"]))
    ideal = worst["runtime_mib"] + worst["shard_mib"] + worst["largest_mib"]
    return {
        "peak_mib": worst["init_peak_mib"],
        "ideal_mib": ideal,
        "ratio": worst["init_peak_mib"] / ideal,
        "init_cpu_s": sum(r["init_cpu_s"] for r in records) / len(records),
        "drawn": max(r["drawn_tensors"] for r in records),
        "launch_s": next(r["launch_to_first_step_s"] for r in records if r["launch_to_first_step_s"] is not None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=list(SHAPES))
    parser.add_argument("--layouts", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--baseline", type=Path, help="another checkout to measure beside this one")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-scale")
    args = parser.parse_args()
    trees = {"this": REPO, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    rows = []
    print(f"{'tree':9} {'path':10} {'size':>5} {'ranks':>5} {'peak MiB':>9} {'ideal':>7} {'ratio':>6} "
          f"{'init CPU s':>10} {'drawn':>6} {'launch->1 s':>11}", flush=True)  # fmt: skip
    for size in args.sizes:
        for path in args.paths:
            for nproc in args.layouts:
                for tree_name, tree in trees.items():
                    work = args.out / f"{tree_name}-{path}-{size}-{nproc}"
                    work.mkdir(parents=True, exist_ok=True)
                    row = {"tree": tree_name, "path": path, "size": size, "ranks": nproc}
                    row |= summarise(measure(tree, path, size, nproc, work))
                    rows.append(row)
                    print(f"{tree_name:9} {path:10} {size:5} {nproc:5} {row['peak_mib']:9.0f} {row['ideal_mib']:7.0f} "
                          f"{row['ratio']:6.2f} {row['init_cpu_s']:10.2f} {row['drawn']:6d} {row['launch_s']:11.1f}",
                          flush=True)  # fmt: skip
    (args.out / "scale.json").write_text(json.dumps(rows, indent=1))
    print_ratios(rows)
    plot(rows, args.out / "scale.png")


def print_ratios(rows: list[dict]) -> None:
    """The goals' ratios: init CPU per rank at x2 and x4 against single; from scratch against pretrained."""
    index = {(r["tree"], r["path"], r["size"], r["ranks"]): r for r in rows}
    print("\nper-rank init CPU against single, and launch -> step 1 of hf against pretrained:")
    for (tree, path, size, ranks), row in sorted(index.items()):
        single = index.get((tree, path, size, 1))
        pretrained = index.get((tree, "pretrained", size, ranks))
        parts = []
        if single and ranks > 1 and single["init_cpu_s"] > 0:
            parts.append(f"init CPU x{ranks}/single {row['init_cpu_s'] / single['init_cpu_s']:.2f}")
        if path == "hf" and pretrained:
            parts.append(f"launch hf/pretrained {row['launch_s'] / pretrained['launch_s']:.2f}")
        if path == "resume" and pretrained:
            parts.append(f"peak resume/pretrained {row['peak_mib'] / pretrained['peak_mib']:.2f}")
        if parts:
            print(f"  {tree:9} {path:10} {size:5} x{ranks}: " + ", ".join(parts))


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib  # lazy: only to draw the figure at the end

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ratio_axis, cpu_axis) = plt.subplots(1, 2, figsize=(11, 4))
    # One colour per init path, one line style per layout (and per tree), so that no two series look alike.
    colours = {path: f"C{index}" for index, path in enumerate(PATHS)}
    dashes = {1: "-", 2: "--", 4: ":"}
    for (tree, path, ranks), series in _series(rows).items():
        sizes = [row["size"] for row in series]
        label = f"{path} x{ranks}" + ("" if tree == "this" else f" ({tree})")
        style = {"color": colours[path], "linestyle": dashes.get(ranks, "-."), "label": label}
        style["marker"] = "o" if tree == "this" else "x"
        ratio_axis.plot(sizes, [row["ratio"] for row in series], **style)
        cpu_axis.plot(sizes, [row["init_cpu_s"] for row in series], **style)
    ratio_axis.axhline(1.15, color="grey", linestyle="--", linewidth=1)
    ratio_axis.set(xlabel="parameters (billions)", ylabel="init peak / ideal, worst rank", xscale="log")
    cpu_axis.set(xlabel="parameters (billions)", ylabel="init CPU seconds per rank", xscale="log", yscale="log")
    cpu_axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    print(f"wrote {out}")


def _series(rows: list[dict]) -> dict[tuple, list[dict]]:
    grouped: dict[tuple, list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["tree"], row["path"], row["ranks"]), []).append(row)
    return {key: sorted(series, key=lambda row: row["size"]) for key, series in grouped.items()}


if __name__ == "__main__":
    main()
