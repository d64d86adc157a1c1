"""Every command the docs show, and how the suite runs it (tests/integration/test_documented_commands.py).

The docs are the source: ``commands_in_docs()`` reads the lines of the ```bash (and ```console ``$``) blocks
of README.md and docs/ (its sub-folders too), and the indented command lines of each examples/*.yaml header. Each must have
an entry in ``COMMANDS`` below, written exactly as the docs show it (comments dropped), and the suite fails
on a command without one. A ``Run`` runs it as written in a fresh directory holding a copy of examples/,
with only the scale-downs its entry names appended (and says why); commands of one ``recipe`` run in one
directory, in order (make the corpus, then train; train, export, load, fine-tune). ``Elsewhere`` is for the
few that need hardware this machine lacks, naming the test that runs their equivalent.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from tests.harness import REPO_ROOT

# docs/benchmarks.md records measurement runs (minutes each) with their output: benchmarks/ is where they
# run, by hand, as its commands say.
DOCS = [REPO_ROOT / "README.md", *sorted(p for p in (REPO_ROOT / "docs").rglob("*.md") if p.name != "benchmarks.md")]
EXAMPLES = sorted((REPO_ROOT / "examples").glob("*.yaml"))
SHELL_BLOCK = re.compile(r"^```(bash|sh|shell|console)\n(.*?)^```", re.S | re.M)
# In an example's leading comments: "#   paratrain train ...", or "#   one process:    paratrain train ...".
HEADER_COMMAND = re.compile(r"^#\s{3,}(?:[\w ]+:\s+)?((?:paratrain|python|torchrun|make)\s.*)$")

SHORT = "train.max_steps=2"  # a layout's start, first steps and save are what a documented command shows
WHY_SHORT = "the command's layout starts, trains and saves; its training math is the parity tests' subject"


@dataclass(frozen=True)
class Run:
    """Run as written, with ``scale_down`` appended (each a ``key=value`` or option the command takes)."""

    scale_down: tuple[str, ...] = ()
    why: str = ""  # why the scale-down; required with one
    recipe: str | None = None  # commands of one recipe share a directory and run in COMMANDS' order
    output: str | None = None  # a text the command's output must hold
    # plain torchrun's stores listen on every interface (pytorch#173909): such a command runs in a network
    # namespace holding only loopback (tests/harness.in_private_network)
    private_network: bool = False


@dataclass(frozen=True)
class Elsewhere:
    """Cannot run on this machine as written; ``test`` runs its equivalent."""

    why: str
    test: str


def short(recipe: str | None = None, *, output: str | None = None) -> Run:
    return Run((SHORT,), WHY_SHORT, recipe, output)


REPLICA_GROUPS_WHY = "runs several processes at once (a lighthouse serving until stopped, one job per group), which a command run after another cannot"
REPLICA_GROUPS_TEST = (
    "tests/integration/test_replica_groups.py: the same commands on loopback (two groups, with and without a kill)"
)

COMMANDS: dict[str, Run | Elsewhere] = {
    # --- README and docs/getting-started.md: set-up -----------------------------------------------------
    "make demo": Elsewhere(
        "sets up .venv (the suite runs inside it) and then runs 'paratrain train examples/quickstart.yaml "
        "--nproc-per-node 2' after removing runs/quickstart",
        "the command 'paratrain train examples/quickstart.yaml --nproc-per-node 2' below, run as written",
    ),
    "make test": Elsewhere("is this suite", ".ci/run runs it on a fresh clone"),
    # --- README, docs/getting-started.md and docs/clusters.md: from one device to many machines ---------
    "paratrain train examples/quickstart.yaml": short(),
    "paratrain train examples/quickstart.yaml parallel.strategy=dp": short(output="layout dp"),
    "paratrain train examples/quickstart.yaml parallel.cp=2 --nproc-per-node 2": short(output="layout fsdp: cp=2"),
    "paratrain train examples/quickstart.yaml --nproc-per-node 2": short("check", output="layout ddp: dp_replicate=2"),
    "torchrun --standalone --nproc-per-node 2 -m paratrain.train examples/quickstart.yaml": Run(
        (SHORT,), WHY_SHORT, output="step 2/2", private_network=True
    ),
    "NCCL_SOCKET_IFNAME=eth1 paratrain train examples/quickstart.yaml --nnodes 2 --nproc-per-node 8 --node-rank 0 "
    "--rdzv-endpoint 10.0.0.1:29500 --max-restarts 3": Elsewhere(
        "needs two machines with 8 GPUs on a network at eth1",
        "tests/integration/test_multinode.py: the same command line on two network namespaces, 2 x 2 processes",
    ),
    "NCCL_SOCKET_IFNAME=eth1 paratrain train examples/quickstart.yaml --nnodes 2 --nproc-per-node 8 --node-rank 1 "
    "--rdzv-endpoint 10.0.0.1:29500 --max-restarts 3": Elsewhere(
        "needs two machines with 8 GPUs on a network at eth1",
        "tests/integration/test_multinode.py: the same command line on two network namespaces, 2 x 2 processes",
    ),
    # --- docs/layouts.md and docs/pipeline.md: sharded, tensor-parallel and pipeline layouts ------------
    # docs/layouts.md: fault-tolerant replica groups
    "paratrain lighthouse --bind 127.0.0.1:29510": Elsewhere(REPLICA_GROUPS_WHY, REPLICA_GROUPS_TEST),
    "paratrain train examples/quickstart.yaml parallel.dp_shard=2 --nproc-per-node 2 --replica-group 0 "
    "--replica-groups 2 --max-restarts 3": Elsewhere(REPLICA_GROUPS_WHY, REPLICA_GROUPS_TEST),
    "paratrain train examples/quickstart.yaml parallel.dp_shard=2 --nproc-per-node 2 --replica-group 1 "
    "--replica-groups 2 --max-restarts 3": Elsewhere(REPLICA_GROUPS_WHY, REPLICA_GROUPS_TEST),
    "paratrain train examples/quickstart.yaml parallel.dp_replicate=2 parallel.dp_shard=2 --nproc-per-node 4": short(
        output="layout hsdp"
    ),
    "paratrain train examples/quickstart.yaml parallel.tp=2 --nproc-per-node 2": short(output="layout tp"),
    "paratrain train examples/quickstart.yaml parallel.dp_shard=2 parallel.tp=2 --nproc-per-node 4": short(
        output="tp=2"
    ),
    "paratrain checkpoint check runs/quickstart parallel.strategy=tp --nproc-per-node 2": Run(recipe="check"),
    "paratrain train examples/quickstart.yaml parallel.pp=2 --nproc-per-node 2": short(output="pp=2"),
    "paratrain train examples/quickstart.yaml parallel.pp=2 pipeline.schedule=Interleaved1F1B --nproc-per-node 2": (
        short(output="Interleaved1F1B")
    ),
    "paratrain train examples/quickstart.yaml parallel.pp=2 --nproc-per-node 4": short(output="dp_replicate=2"),
    "paratrain train examples/quickstart.yaml parallel.pp=2 parallel.dp_shard=2 --nproc-per-node 4": short(
        output="dp_shard=2"
    ),
    "paratrain train examples/quickstart.yaml parallel.strategy=model_parallel pipeline.devices=[cuda:0,cuda:1]": (
        Elsewhere(
            "needs two GPUs",
            "tests/gpu (pytest -m gpu) on a lent GPU; on CPU tests/parity/test_pipeline_matches_single.py runs "
            "model_parallel with pipeline.devices=[cpu,cpu]",
        )
    ),
    "paratrain pipeline show examples/quickstart.yaml parallel.pp=2 --nproc-per-node 2": Run(output="bubble"),
    # the move of docs/layouts.md: fsdp x4 (also in the commands of docs/layouts.md), then ddp x2 resumes its checkpoint
    "paratrain train examples/quickstart.yaml parallel.dp_shard=4 --nproc-per-node 4": short(
        "move", output="layout fsdp"
    ),
    "paratrain train examples/quickstart.yaml parallel.strategy=ddp --nproc-per-node 2": short(
        "move", output="resumed from runs/quickstart/checkpoints/step-2"
    ),
    # --- docs/models.md and examples/hf_llama.yaml: a transformers model, exported, loaded, fine-tuned ---
    "paratrain train examples/hf_llama.yaml --nproc-per-node 2": Run(
        ("train.max_steps=10",), "export and fine-tuning need a checkpoint, not 200 steps of training", "hf"
    ),
    "paratrain export runs/hf_llama --hf out/llama": Run(recipe="hf", output="step-10"),
    "python -c \"import transformers; transformers.AutoModelForCausalLM.from_pretrained('out/llama')\"": Run(
        recipe="hf"
    ),
    "paratrain train examples/hf_llama.yaml 'model.args={}' model.pretrained=out/llama run.output_dir=runs/hf_llama_ft "
    "--nproc-per-node 2": short("hf", output="step 2/2"),
    # --- docs/fine-tuning.md and examples/hf_sft_lora.yaml: chat data, LoRA, the adapter exported and loaded ---
    "python -m paratrain.tools.sft_example runs/sft/data": Run(recipe="sft"),
    "paratrain train examples/hf_sft_lora.yaml --nproc-per-node 2": Run(
        ("train.max_steps=10",), "export needs a checkpoint, not 150 steps of training", "sft"
    ),
    "paratrain export runs/hf_sft_lora --hf out/adapter": Run(recipe="sft", output="step-10"),
    'python -c "import peft, transformers; peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.'
    "from_pretrained('runs/sft/data/base'), 'out/adapter')\"": Run(recipe="sft"),
    "paratrain export runs/hf_sft_lora --hf out/merged --merge": Run(recipe="sft", output="step-10"),
    # --- examples/hf_dpo_lora.yaml and docs/fine-tuning.md: preference tuning (DPO) with LoRA ----------------
    "python -m paratrain.tools.sft_example runs/dpo/data": Run(recipe="dpo"),
    "paratrain train examples/hf_dpo_lora.yaml --nproc-per-node 2": Run(
        ("train.max_steps=4", "checkpoint.every_steps=4"),
        "export needs a checkpoint, not 60 steps of training",
        "dpo",
        output="DPO: the reference log-probabilities",
    ),
    "paratrain export runs/hf_dpo_lora --hf out/dpo-adapter": Run(recipe="dpo", output="step-4"),
    # --- examples/gpt_moe.yaml: paratrain's GPT with a mixture-of-experts feed-forward, fsdp over 2 ranks ----
    "paratrain train examples/gpt_moe.yaml --nproc-per-node 2 train.max_steps=10": Run(output="layout fsdp"),
    "paratrain train examples/gpt_moe.yaml parallel.ep=2 --nproc-per-node 2 train.max_steps=10": Run(
        output="layout fsdp: dp_shard=2, ep=2"
    ),
    # --- docs/data.md and examples/llama_text.yaml: a corpus made locally, then trained on --------------
    "python -m paratrain.data.stdlib_corpus runs/llama_text/data": Run(recipe="corpus"),
    "paratrain train examples/llama_text.yaml --nproc-per-node 2": short("corpus"),
    "paratrain train examples/llama_text.yaml data.args.document_mask=true parallel.cp=2 --nproc-per-node 2": Run(
        (SHORT, "run.output_dir=runs/llama_text_documents"),
        "its own output directory: the command above left runs/llama_text's checkpoints, which a changed "
        "data.args would refuse to resume; " + WHY_SHORT,
        recipe="corpus",
        output="layout fsdp: cp=2",
    ),
    # --- docs/tracking.md, docs/clusters.md, docs/planner.md: reports, collectives, verify, planning ----
    "paratrain train examples/quickstart.yaml optim.lr=1e-3 run.output_dir=runs/lr-1e-3": short("report"),
    "paratrain train examples/quickstart.yaml optim.lr=3e-3 run.output_dir=runs/lr-3e-3": short("report"),
    "paratrain report runs/lr-1e-3 runs/lr-3e-3 --out reports/lr": Run(recipe="report", output="report.html"),
    "paratrain bench comm --nproc-per-node 2 --sizes 1MB 16MB --iters 20": Run(output="all_reduce"),
    "paratrain verify examples/quickstart.yaml parallel.dp_shard=2 --nproc-per-node 2 --steps 20": Run(
        ("--steps", "3"), "three steps show the verdict; the parity tests compare 12 and more", output="PASS"
    ),
    "paratrain verify examples/gpt_7b.yaml precision=fp32 model.args.n_layer=2 model.args.n_head=4 "
    "model.args.n_embd=256 model.args.vocab_size=128 model.args.block_size=64 data.args.block_size=64 parallel.dp_shard=2 parallel.tp=2 "
    "train.global_batch_size=16 --nproc-per-node 4 --steps 10": Run(
        ("--steps", "2"), "two steps show the verdict; the parity tests compare 12 and more", output="PASS"
    ),
    "paratrain plan examples/gpt_7b.yaml --gpus 64 --nodes 8 --gpu-memory 80GB --host-memory 2TB": Run(
        output="recommended:"
    ),
    "paratrain plan examples/hf_llama.yaml --gpus 2 --gpu-memory 80GB": Run(output="host memory of "),
    "paratrain train examples/gpt_7b.yaml --dry-run --nproc-per-node 8 --nnodes 8 parallel.strategy=fsdp "
    "parallel.pp=4 parallel.tp=4": Run(output="dry run: 64 ranks"),
    # --- examples' headers ------------------------------------------------------------------------------
    "paratrain train examples/gpt_1b.yaml --nproc-per-node 8": Elsewhere(
        "needs 8 GPUs (train.device=cuda, bf16, compile)",
        "tests/gpu and benchmarks/mfu.py on a lent GPU; its layout at small size in "
        "tests/integration/test_combination_matrix.py",
    ),
    "paratrain train examples/mlp_regression.yaml": Run(("train.max_steps=20",), "20 of 1600 steps show it trains"),
    "paratrain train examples/mlp_regression.yaml parallel.strategy=ddp --nproc-per-node 2": Run(
        ("train.max_steps=20",), "20 of 1600 steps show it trains", output="layout ddp"
    ),
}


def commands_in_docs() -> dict[tuple[str, ...], list[str]]:
    """Each documented command (as its argv) and where it is shown."""
    found: dict[tuple[str, ...], list[str]] = {}
    for doc in DOCS:
        for language, block in SHELL_BLOCK.findall(doc.read_text()):
            for line in _logical_lines(block):
                if language == "console" and not line.startswith("$ "):
                    continue  # a console block's other lines are output
                _add(found, line.removeprefix("$ "), doc)
    for example in EXAMPLES:
        for line in _leading_comments(example):
            if match := HEADER_COMMAND.match(line):
                _add(found, match.group(1), example)
    return found


def argv_of(command: str) -> tuple[str, ...]:
    return tuple(shlex.split(command, comments=True))


def _add(found: dict[tuple[str, ...], list[str]], line: str, where: Path) -> None:
    argv = argv_of(line)
    if argv:
        found.setdefault(argv, []).append(str(where.relative_to(REPO_ROOT)))


def _logical_lines(block: str) -> list[str]:
    """The block's lines, a line ending in a backslash joined with the next."""
    lines, pending = [], ""
    for line in block.splitlines():
        pending = f"{pending} {line.strip()}" if pending else line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        lines.append(pending)
        pending = ""
    return lines


def _leading_comments(example: Path) -> list[str]:
    lines = example.read_text().splitlines()
    return lines[: next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))]
