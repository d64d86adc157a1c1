"""paratrain against torchtitan on one GPU: the same Llama shape, data, batch, bf16 and compile, back to back.

The model is shaped like Llama 3.2 1B (width 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, vocabulary
128,256, RoPE theta 500,000, untied embeddings: 1.50B parameters). torchtitan (0.2.2) trains its own
Llama 3 implementation at that shape (benchmarks/torchtitan_llama.py registers the flavour); paratrain
trains a transformers LlamaForCausalLM built from a config of the same shape (same parameter count and
FLOPs per token). Both: sequence 2048, micro-batch 8, one process, bf16, torch.compile of each block and
of the loss, no activation checkpointing, fused AdamW, sdpa causal attention. On one GPU torchtitan does
not shard (FSDP is off at data-parallel degree 1) and trains under AMP autocast bf16 with fp32 weights;
paratrain runs twice: ``single`` (the same: autocast bf16, fp32 weights) and ``fsdp`` (examples/gpt_1b.yaml's
recommended layout: FSDP2 at world size 1, parameters bf16, reductions fp32, plus autocast). Both read
one corpus (the Python standard library's docstrings joined into 8 long documents) through one
byte-level BPE tokenizer trained here.

Per run it prints tokens/s (median of the steps after --skip-steps), TFLOP/s by one formula for all
(6 x 1.236e9 matmul parameters + 12 x layers x width x sequence, per token: torchtitan's and the PaLM
paper's), MFU against the GPU's dense bf16 peak, and the peak reserved GPU memory; then the ratio
paratrain / torchtitan of tokens/s (goal >= 1.0). It prints the exact command of each run. GPU only
(paratrain's half needs CUDA for bf16 compile). Prints, never asserts; results go in docs/benchmarks.md.

Start-up: every output line is stamped with the seconds since its process was launched as it arrives
(the logs keep the stamps), and each run prints when its milestones came, the last being the end of step 1
(launch to end of step 1 / torchtitan's is the start-up ratio): torchtitan's "Starting job" (imports
done), "Building" (process group, tokenizer and data loader up), "Trainer is initialized" (model built on
meta, compiled, initialised on the GPU, optimizer); paratrain's memory check (imports, config, preflight),
"layout" (process group), "model ready" (data loaded, model built, initialised, laid out).

    python3 benchmarks/vs_torchtitan.py --steps 30 --skip-steps 10     # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
LAYERS, WIDTH, SEQUENCE, VOCAB = 16, 2048, 2048, 128256
MATMUL_PARAMETERS = LAYERS * (2 * WIDTH * WIDTH + 2 * WIDTH * 512 + 3 * WIDTH * 8192) + VOCAB * WIDTH
FLOPS_PER_TOKEN = 6 * MATMUL_PARAMETERS + 12 * LAYERS * WIDTH * SEQUENCE
LLAMA_ARGS = (
    "{model_type: llama, vocab_size: 128256, hidden_size: 2048, intermediate_size: 8192, num_hidden_layers: 16, "
    "num_attention_heads: 32, num_key_value_heads: 8, max_position_embeddings: 2048, tie_word_embeddings: false, "
    "rope_theta: 500000.0, rms_norm_eps: 1.0e-5}"
)
TITAN_STEP = re.compile(r"step:\s*(\d+).*?memory:\s*(-?[\d.]+)GiB.*?tps:\s*([\d,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STAMP = re.compile(r"^\[\+\s*([\d.]+)s\] ")
# Start-up milestones, in the order each framework reaches them; "step 1" ends each list.
MILESTONES = {
    "torchtitan": {
        "started": re.compile(r"Starting job"),
        "data ready": re.compile(r"Building llama3 "),
        "model ready": re.compile(r"Trainer is initialized"),
        "step 1": re.compile(r"step:\s*1\s"),
    },
    "paratrain": {
        "started": re.compile(r"paratrain: memory check"),
        "process group": re.compile(r"paratrain: layout "),
        "model ready": re.compile(r"paratrain: model ready"),
        "step 1": re.compile(r"paratrain: step 1/"),
    },
}


@dataclass(frozen=True)
class Result:
    framework: str
    tokens_per_s: float
    peak_reserved_gib: float
    steps_kept: int
    milestones: dict[str, float] = field(default_factory=dict)  # seconds from launch, MILESTONES' names

    def startup_line(self) -> str:
        reached = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.milestones.items())
        return f"{self.framework} start-up (from launch): {reached or 'no milestone seen'}"

    def line(self, peak_flops: float | None) -> str:
        flops = self.tokens_per_s * FLOPS_PER_TOKEN
        mfu = f"{flops / peak_flops:.1%}" if peak_flops else "n/a"
        return (
            f"{self.framework}: {self.tokens_per_s:,.0f} tokens/s, {flops / 1e12:.0f} TFLOP/s, MFU {mfu}, "
            f"peak reserved {self.peak_reserved_gib:.1f} GiB (median of {self.steps_kept} steps)"
        )


def make_data(directory: Path, *, source_mb: float = 0) -> tuple[Path, Path]:
    """(corpus folder, tokenizer folder): 8 long documents and a tokenizer both frameworks read. The documents
    join the standard library's docstrings (about 100k tokens), or with ``source_mb`` its source files up to
    that many MB (a corpus a 300-step run does not memorise: 24 MB is about one pass)."""
    subprocess.run([sys.executable, "-m", "paratrain.data.stdlib_corpus", str(directory)], check=True, cwd=REPO_ROOT)
    if source_mb:
        documents = stdlib_sources(int(source_mb * 1e6))
    else:
        documents = [json.loads(line)["text"] for line in (directory / "corpus.jsonl").read_text().splitlines()]
    corpus = directory / "long"
    corpus.mkdir()
    share = len(documents) // 8
    joined = ["\n\n".join(documents[i * share : (i + 1) * share]) for i in range(8)]
    (corpus / "corpus.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in joined))
    tokenizer = directory / "tokenizer"
    tokenizer.mkdir()
    shutil.copy(directory / "tokenizer.json", tokenizer / "tokenizer.json")
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(special))
    return corpus, tokenizer


def stdlib_sources(budget_bytes: int) -> list[str]:
    """The standard library's own .py files (installed packages left out), in path order, up to the budget."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if {"site-packages", "dist-packages"} & set(path.parts):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text.encode())
        if total >= budget_bytes:
            break
    return texts


def titan_command(dump: Path, corpus: Path, tokenizer: Path, *, steps: int, micro_batch: int) -> list[str]:
    """torchtitan's defaults where the comparison fixes nothing (AdamW fused, AMP bf16 at one GPU)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "torchtitan.train",
        "--experimental.custom_import", "torchtitan_llama", "--model.name", "llama3", "--model.flavor", "1B_matched",
        "--model.hf_assets_path", str(tokenizer), "--training.dataset", "c4_test", "--training.dataset_path", str(corpus),
        "--training.local_batch_size", str(micro_batch), "--training.seq_len", str(SEQUENCE),
        "--training.steps", str(steps), "--training.mixed_precision_param", "bfloat16",
        "--lr_scheduler.warmup_steps", "2", "--compile.enable", "--compile.components", "model,loss",
        "--activation_checkpoint.mode", "none", "--metrics.log_freq", "1", "--job.dump_folder", str(dump),
    ]  # fmt: skip


def run_stamped(command: list[str], log: Path, *, cwd: Path, env: dict[str, str] | None = None) -> int:
    """Runs ``command`` with its output (stdout and stderr) written to ``log`` line by line, each line
    stamped ``[+SECONDS s]`` with the time since launch at which it arrived. Returns the exit code."""
    start = time.perf_counter()
    with (
        log.open("w") as out,
        subprocess.Popen(
            command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        ) as process,
    ):
        for line in process.stdout:
            out.write(f"[+{time.perf_counter() - start:8.2f}s] {line}")
            out.flush()
    return process.returncode


def milestones_of(log: Path, framework: str) -> dict[str, float]:
    """{milestone: seconds from launch} of the first line matching each of ``framework``'s MILESTONES."""
    seen: dict[str, float] = {}
    for line in log.read_text().splitlines():
        stamp = STAMP.match(line)
        if not stamp:
            continue
        text = ANSI.sub("", line[stamp.end() :])
        for name, pattern in MILESTONES[framework].items():
            if name not in seen and pattern.search(text):
                seen[name] = float(stamp[1])
    return {name: seen[name] for name in MILESTONES[framework] if name in seen}


def run_torchtitan(work: Path, corpus: Path, tokenizer: Path, *, steps: int, micro_batch: int) -> Path:
    path = os.pathsep.join(filter(None, [str(REPO_ROOT / "benchmarks"), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    command = titan_command(work / "torchtitan", corpus, tokenizer, steps=steps, micro_batch=micro_batch)
    print("torchtitan:", " ".join(command), flush=True)
    log = work / "torchtitan.log"
    returncode = run_stamped(command, log, env=env, cwd=work)
    if returncode != 0:
        raise RuntimeError(f"torchtitan exited with {returncode}:\n{log.read_text()[-4000:]}")
    return log


def torchtitan_result(log: Path, *, skip_steps: int) -> Result:
    steps = {}
    for line in log.read_text().splitlines():
        match = TITAN_STEP.search(ANSI.sub("", line))
        if match:
            steps[int(match[1])] = (float(match[3].replace(",", "")), float(match[2]))
    kept = [value for step, value in steps.items() if step > skip_steps]
    if not kept:
        raise RuntimeError(f"no torchtitan step after {skip_steps} in {log}")
    tokens_per_s, peak = statistics.median(t for t, _ in kept), max(m for _, m in steps.values())
    return Result("torchtitan", tokens_per_s, peak, len(kept), milestones_of(log, "torchtitan"))


PARATRAIN_LAYOUTS = {
    "single": ["parallel.strategy=single"],
    "fsdp": ["parallel.strategy=fsdp", "parallel.fsdp={param_dtype: bf16, reduce_dtype: fp32}"],
}


def paratrain_command(
    run_dir: Path, corpus: Path, tokenizer: Path, *, layout: str, steps: int, micro_batch: int
) -> list[str]:
    callbacks = (
        "callbacks=[{factory: paratrain.callbacks.throughput:ThroughputMonitor, "
        f"args: {{flops_per_sample: {FLOPS_PER_TOKEN * SEQUENCE}}}}}, "
        "{factory: paratrain.callbacks.memory:MemoryMonitor}]"
    )
    return [
        sys.executable, "-m", "paratrain.cli", "train", "examples/hf_llama.yaml",
        f"model.args={LLAMA_ARGS}",
        f"data.args={{files: {corpus / 'corpus.jsonl'}, tokenizer: {tokenizer / 'tokenizer.json'}, "
        f"block_size: {SEQUENCE}, cache_dir: {run_dir / 'cache'}}}",
        "data.factory=paratrain.data.lm:packed_text", "data.num_workers=2",
        f"train.global_batch_size={micro_batch}", f"train.micro_batch_size={micro_batch}",
        f"train.max_steps={steps}", "train.device=cuda", "precision=bf16", "parallel.compile=true",
        *PARATRAIN_LAYOUTS[layout],
        "checkpoint.every_steps=0", "checkpoint.save_final=false", "log.every_steps=1",
        f"run.output_dir={run_dir}", callbacks,
    ]  # fmt: skip


def run_paratrain(work: Path, corpus: Path, tokenizer: Path, *, layout: str, steps: int, micro_batch: int) -> Path:
    run_dir = work / f"paratrain-{layout}"
    command = paratrain_command(run_dir, corpus, tokenizer, layout=layout, steps=steps, micro_batch=micro_batch)
    print(f"paratrain {layout}:", " ".join(command), flush=True)
    log = work / f"paratrain-{layout}.log"
    returncode = run_stamped(command, log, cwd=REPO_ROOT)
    if returncode != 0:
        raise RuntimeError(f"paratrain exited with {returncode}:\n{log.read_text()[-4000:]}")
    return run_dir / "metrics.jsonl"


def paratrain_result(layout: str, metrics: Path, *, skip_steps: int, log: Path | None = None) -> Result:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    kept = [record for record in records if record.get("step", 0) > skip_steps and "tokens_per_s" in record]
    if not kept:
        raise RuntimeError(f"no paratrain step after {skip_steps} in {metrics}")
    peak_mb = max(record.get("mem_peak_reserved_mb_max", 0) for record in records)
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in kept)
    milestones = milestones_of(log, "paratrain") if log is not None and log.exists() else {}
    return Result(f"paratrain {layout}", tokens_per_s, peak_mb / 1024, len(kept), milestones)


def gpu_peak_bf16() -> tuple[str, float | None]:
    import torch

    from paratrain.callbacks.throughput import peak_flops_of

    name = torch.cuda.get_device_name()
    return name, peak_flops_of(name, "bf16")


def measure(run: str, work: Path, corpus: Path, tokenizer: Path, args: argparse.Namespace) -> Result:
    """One run: "torchtitan", or "paratrain-LAYOUT"."""
    size = {"steps": args.steps, "micro_batch": args.micro_batch}
    if run == "torchtitan":
        return torchtitan_result(run_torchtitan(work, corpus, tokenizer, **size), skip_steps=args.skip_steps)
    layout = run.removeprefix("paratrain-")
    metrics = run_paratrain(work, corpus, tokenizer, layout=layout, **size)
    return paratrain_result(layout, metrics, skip_steps=args.skip_steps, log=work / f"paratrain-{layout}.log")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip-steps", type=int, default=10, help="compile and warm-up steps left out")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument(
        "--runs", default="torchtitan,paratrain-single,paratrain-fsdp", help="comma-separated, in the order run"
    )
    parser.add_argument("--out-dir", type=Path, help="keep the runs and logs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    name, peak = gpu_peak_bf16()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.out_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        corpus, tokenizer = make_data(work / "data")
        for run in args.runs.split(","):
            try:
                results[run] = measure(run, work, corpus, tokenizer, args)
            except RuntimeError as error:
                print(f"{run} FAILED: {error}", flush=True)
    print(f"device: {name}; FLOPs per token {FLOPS_PER_TOKEN:.3e}; sequence {SEQUENCE}, micro-batch {args.micro_batch}")
    for result in results.values():
        print(result.line(peak))
        print(result.startup_line())
    titan = results.get("torchtitan")
    for run, result in results.items():
        if titan and run != "torchtitan":
            print(f"{result.framework} / torchtitan tokens/s: {result.tokens_per_s / titan.tokens_per_s:.3f}")
            first_steps = result.milestones.get("step 1"), titan.milestones.get("step 1")
            if all(first_steps):
                ratio = first_steps[0] / first_steps[1]
                print(f"{result.framework} / torchtitan launch to end of step 1: {ratio:.2f}")


if __name__ == "__main__":
    main()
