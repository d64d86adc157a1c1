"""The command line's declarations: every command, its options and their help, and which function runs it
(``commands.py``, or ``train_handoff.py`` for ``train``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from paratrain.cli import commands, train_handoff


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parses options and ``key=value`` overrides in any order (argparse alone wants them grouped)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    unknown = [item for item in extra if item.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def add_config_arguments(
    parser: argparse.ArgumentParser, *, overrides_help: str = "dotted config overrides, as for train"
) -> None:
    """The YAML file and its ``key=value`` overrides, as every command that reads a config takes them."""
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=overrides_help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paratrain", description="PyTorch-native distributed training.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add_parser in (
        add_train_parser,
        add_config_parser,
        add_export_parser,
        add_pipeline_parser,
        add_report_parser,
        add_bench_parser,
        add_verify_parser,
        add_slurm_parser,
        add_checkpoint_parser,
        add_plan_parser,
        add_lighthouse_parser,
    ):
        add_parser(subparsers)
    return parser


def add_train_parser(subparsers: argparse._SubParsersAction) -> None:
    """``paratrain train CONFIG [key=value ...]``: one process, torchrun workers, or ``--dry-run``."""
    train = subparsers.add_parser("train", help="train from a YAML config")
    add_config_arguments(train, overrides_help="dotted config overrides, e.g. train.max_steps=50")
    train.add_argument("--nproc-per-node", type=int, default=1, help="processes on this node (one per GPU)")
    train.add_argument("--nnodes", type=int, help="number of nodes (default 1; inside srun: SLURM_NNODES)")
    train.add_argument("--node-rank", type=int, default=0, help="this node's rank, 0..nnodes-1")
    train.add_argument("--rdzv-endpoint", help="HOST:PORT of node 0, the same on every node (multi-node)")
    train.add_argument("--max-restarts", type=int, default=0, help="restart the group this often after a failure")
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="build the mesh (fake process group), the model on meta and the layout for the whole world in "
        "this one process; print each rank's place and expected memory; train nothing",
    )
    train.add_argument(
        "--skip-memory-check",
        action="store_true",
        help="start even when the planner estimates that a process needs more memory than is free "
        "(train.check_memory=false)",
    )
    train.add_argument(
        "--replica-group", type=int, metavar="I", help="this job's fault-tolerant replica group, 0..N-1 (torchft)"
    )
    train.add_argument(
        "--replica-groups", type=int, metavar="N", help="replica groups of the run, each started as its own job"
    )
    train.set_defaults(handler=train_handoff.train_command)


def add_lighthouse_parser(subparsers: argparse._SubParsersAction) -> None:
    """``paratrain lighthouse``: torchft's quorum server, which every replica group joins."""
    lighthouse = subparsers.add_parser(
        "lighthouse", help="serve the quorum of fault-tolerant replica groups (torchft's lighthouse)"
    )
    lighthouse.add_argument(
        "--bind",
        default="127.0.0.1:29510",
        help="HOST:PORT to listen on (default loopback; a cluster: the node's address; PORT 0: a free one)",
    )
    lighthouse.add_argument(
        "--address-file",
        type=Path,
        default=None,
        help="write the address it serves at to this file once it listens (how a script learns a PORT 0 bind)",
    )
    lighthouse.add_argument("--min-replicas", type=int, default=1, help="groups a quorum needs (default 1)")
    # A live group that is slow to ask for the next quorum must be waited for, or the others form a quorum
    # without it and both sides step apart: the join timeout must exceed a step (torchft's default, 60 s).
    # A dead group stops its heartbeats and is left out after --heartbeat-timeout-ms instead.
    lighthouse.add_argument(
        "--join-timeout-ms",
        type=int,
        default=60000,
        help="how long a quorum waits for a live group to ask for it (longer than a step; default 60000)",
    )
    lighthouse.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=5000,
        help="a group without heartbeats for longer is dead: left out of the quorum (default 5000)",
    )
    lighthouse.set_defaults(handler=commands.lighthouse_command)


def add_config_parser(subparsers: argparse._SubParsersAction) -> None:
    """``paratrain config show CONFIG``: the resolved config."""
    config = subparsers.add_parser("config", help="inspect configs")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser("show", help="print the fully resolved config")
    add_config_arguments(show)
    show.set_defaults(handler=commands.config_show_command)


def add_export_parser(subparsers: argparse._SubParsersAction) -> None:
    """``paratrain export CHECKPOINT --out FILE | --hf DIR``: consolidated weights."""
    export = subparsers.add_parser("export", help="write consolidated model weights from a checkpoint")
    export.add_argument(
        "checkpoint", help="a step-<N> checkpoint directory, or a run directory for its newest complete checkpoint"
    )
    target = export.add_mutually_exclusive_group(required=True)
    target.add_argument("--out", help="output .safetensors file")
    target.add_argument("--hf", metavar="OUT_DIR", help="output Hugging Face model directory (transformers models)")
    export.add_argument(
        "--merge",
        action="store_true",
        help="with --hf, a LoRA run: the model with its adapter merged in (default: the adapter)",
    )
    export.set_defaults(handler=commands.export_command)


def add_pipeline_parser(subparsers: argparse._SubParsersAction) -> None:
    """``paratrain pipeline show CONFIG``: each rank's schedule and its bubble."""
    pipeline = subparsers.add_parser("pipeline", help="inspect pipeline schedules")
    pipeline_commands = pipeline.add_subparsers(dest="pipeline_command", required=True)
    pipeline_show = pipeline_commands.add_parser(
        "show", help="print each rank's schedule timeline and bubble, and draw it as a PNG"
    )
    add_config_arguments(pipeline_show)
    pipeline_show.add_argument("--nproc-per-node", type=int, default=1, help="processes per node, as for train")
    pipeline_show.add_argument("--nnodes", type=int, default=1, help="number of nodes, as for train")
    pipeline_show.add_argument("--out", help="PNG path (default: OUTPUT_DIR/pipeline/schedule.png)")
    pipeline_show.add_argument("--run", help="run directory whose recorded timelines to measure (default: OUTPUT_DIR)")
    pipeline_show.set_defaults(handler=commands.pipeline_show_command)


def add_report_parser(subparsers: argparse._SubParsersAction) -> None:
    """``paratrain report RUN_DIR ...``: plots and one HTML page."""
    report = subparsers.add_parser("report", help="plot runs' metrics (PNG) and write one self-contained HTML page")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run output directories, overlaid in every plot")
    report.add_argument("--out", help="output directory (default: the first RUN_DIR/report)")
    report.set_defaults(handler=commands.report_command)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """``paratrain bench comm``: collectives over a size sweep."""
    bench = subparsers.add_parser("bench", help="micro-benchmarks")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    comm = bench_commands.add_parser(
        "comm", help="time collectives over a size sweep; algbw and busbw as nccl-tests defines them"
    )
    comm.add_argument("--nproc-per-node", type=int, default=2, help="processes (one per GPU on CUDA)")
    comm.add_argument("--sizes", nargs="+", help="sizes S in bytes, binary units (1KB = 1024 B); default 1KB to 16MB")
    comm.add_argument("--iters", type=int, default=20, help="timed iterations per operation and size")
    comm.add_argument("--warmup", type=int, default=5, help="untimed iterations before them")
    comm.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CUDA with NCCL when present, else CPU with gloo",
    )
    comm.add_argument("--out", default="runs/bench-comm", help="directory for comm.json and comm.png")
    comm.set_defaults(handler=commands.bench_comm_command)


def add_verify_parser(subparsers: argparse._SubParsersAction) -> None:
    """``paratrain verify CONFIG``: the layout against one process, loss by loss."""
    verify = subparsers.add_parser(
        "verify", help="train the config's layout and one process for a few steps and compare losses"
    )
    add_config_arguments(verify)
    verify.add_argument(
        "--nproc-per-node", type=int, help="processes for the layout (default: 2, or 1 for single, dp, model_parallel)"
    )
    verify.add_argument("--steps", type=int, default=20, help="optimizer steps each run trains (default 20)")
    verify.set_defaults(handler=commands.verify_command)


def add_slurm_parser(subparsers: argparse._SubParsersAction) -> None:
    """``paratrain slurm CONFIG --nodes N --gpus-per-node G``: an sbatch script."""
    slurm = subparsers.add_parser(
        "slurm", help="write (and with --submit, submit) an sbatch script: one launcher per node, requeue on 75"
    )
    add_config_arguments(slurm)
    slurm.add_argument("--nodes", type=int, required=True, help="nodes to request")
    slurm.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node, one process each")
    slurm.add_argument("--time", help="time limit, as sbatch --time (e.g. 24:00:00)")
    slurm.add_argument("--partition", help="partition, as sbatch --partition")
    slurm.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: request CPUs, not GPUs (one per process)"
    )
    slurm.add_argument(
        "--replica-groups",
        type=int,
        default=1,
        metavar="N",
        help="fault-tolerant replica groups sharing the nodes out: a lighthouse step and one step per group",
    )
    slurm.add_argument(
        "--max-restarts",
        type=int,
        help="restarts of each launcher's workers (default: 3 with --replica-groups, else 0)",
    )
    slurm.add_argument("--out", help="script path (default: OUTPUT_DIR/slurm.sbatch)")
    slurm.add_argument("--submit", action="store_true", help="submit the script with sbatch")
    slurm.set_defaults(handler=commands.slurm_command)


def add_checkpoint_parser(subparsers: argparse._SubParsersAction) -> None:
    """``paratrain checkpoint check CHECKPOINT [key=value ...]``: load under a layout without training."""
    checkpoint = subparsers.add_parser("checkpoint", help="inspect checkpoints")
    checkpoint_commands = checkpoint.add_subparsers(dest="checkpoint_command", required=True)
    check = checkpoint_commands.add_parser(
        "check",
        help="load a checkpoint under a layout (its own config plus overrides) without training, and say what moved",
    )
    check.add_argument(
        "checkpoint", help="a step-<N> checkpoint directory, or a run directory for its newest complete checkpoint"
    )
    check.add_argument("overrides", nargs="*", metavar="key=value", help="the layout to try, e.g. parallel.dp_shard=2")
    check.add_argument("--nproc-per-node", type=int, default=1, help="processes of the layout to try")
    check.set_defaults(handler=commands.checkpoint_check_command)


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    """``paratrain plan CONFIG --gpus N --gpu-memory SIZE [--host-memory SIZE] [--mtbf-hours H]``: every layout
    ranked, and the checkpoint interval."""
    plan = subparsers.add_parser(
        "plan", help="memory per GPU of every layout a cluster allows, ranked, with a recommendation"
    )
    add_config_arguments(plan)
    plan.add_argument("--gpus", type=int, required=True, help="GPUs in the cluster (all nodes)")
    plan.add_argument("--gpu-memory", required=True, help="memory per GPU, e.g. 80GB (10^9 B) or 80GiB (2^30 B)")
    plan.add_argument(
        "--nodes", type=int, default=1, help="nodes the GPUs are spread over evenly (tensor parallel stays in one)"
    )
    plan.add_argument(
        "--host-memory",
        help="host memory (RAM) per node, e.g. 2TB; default: this machine's (MemTotal in /proc/meminfo)",
    )
    plan.add_argument(
        "--mtbf-hours",
        type=float,
        help="one node's mean time between failures, hours, for the checkpoint interval; default: checkpoint.mtbf_hours",
    )
    plan.add_argument(
        "--save-bandwidth", default="1GB", help="what one node writes to checkpoint storage per second (default 1GB)"
    )
    plan.set_defaults(handler=commands.plan_command)
