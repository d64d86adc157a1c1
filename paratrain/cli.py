"""``paratrain train | config show | export | pipeline show``: the command line, and how it hands off to workers."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from paratrain.checkpoint.manifest import named_checkpoint
from paratrain.checks.warnings import ineffective_options
from paratrain.config.schema import Config, config_to_yaml, load_config
from paratrain.errors import RUN_ENDINGS, CheckpointWriteError, ConfigError, Preempted, exit_code_of
from paratrain.launch.launcher import LaunchOptions

if TYPE_CHECKING:
    from paratrain.parallel.dims import ParallelDims


def main(argv: list[str] | None = None) -> int:
    # Like `python -m`, so factories in the user's project directory import.
    sys.path.insert(0, os.getcwd())
    args = parse_args(argv)
    try:
        return args.handler(args)
    except RUN_ENDINGS as error:
        say_how_it_ended(error)
        return exit_code_of(error)


def say_how_it_ended(error: Exception) -> None:
    """The message alone, no traceback: it already names the key and the fix (a stop in a one-process run
    trained in this one says where it stopped; a failed save was reported by the checkpointer)."""
    if isinstance(error, CheckpointWriteError):
        return
    print(f"paratrain: {error}" if isinstance(error, Preempted) else f"paratrain: error: {error}", file=sys.stderr)


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


def train_command(args: argparse.Namespace) -> int:
    # lazy: each command loads only what it runs, so every `paratrain` call starts fast
    from paratrain.launch.slurm import apply_slurm_environment

    options = LaunchOptions(
        args.nproc_per_node, args.nnodes or 1, args.node_rank, args.rdzv_endpoint, args.max_restarts
    )
    # Inside an srun step every node runs this same command: Slurm says which node this is.
    options = apply_slurm_environment(options, os.environ, nnodes_given=args.nnodes is not None)
    if args.skip_memory_check:  # an override, so workers the launcher starts skip it too
        args.overrides = [*args.overrides, "train.check_memory=false"]
    args.overrides = [*args.overrides, *replica_group_overrides(args)]
    if args.dry_run:  # before options.validate(): planning a multi-node world needs no rendezvous endpoint
        return dry_run_command(args)
    options.validate()
    config = load_config(args.config, args.overrides)
    # Lazy: imported once the config parses; preflight loads torch.distributed and the planner loads torch.
    from paratrain.checks.preflight import preflight
    from paratrain.parallel.dims import resolve_parallel_dims
    from paratrain.planner.memory_check import describe_auto_choice, maybe_resolve_auto

    auto = config.parallel.strategy == "auto"
    config = maybe_resolve_auto(config, world_size=options.world_size, nproc_per_node=options.nproc_per_node)
    if auto:
        print(f"paratrain: {describe_auto_choice(config)}", file=sys.stderr)
    preflight(config, world_size=options.world_size, nproc_per_node=options.nproc_per_node)
    dims = resolve_parallel_dims(
        config.parallel, world_size=options.world_size, local_world_size=options.nproc_per_node
    )
    for warning in ineffective_options(config, dims):
        print(f"paratrain: warning: {warning}", file=sys.stderr)
    if dims.ft_enabled:
        from paratrain.launch.replica_groups import check_lighthouse_reachable  # lazy: as the imports above

        check_lighthouse_reachable(config.parallel.fault_tolerance)
    # One run per output directory, held by node 0's launcher (or the one process) until it exits.
    with maybe_holding_run_lock(config.run.output_dir, node_rank=options.node_rank):
        return run_or_launch(config, dims, options, args, auto=auto)


def replica_group_overrides(args: argparse.Namespace) -> list[str]:
    """``--replica-group I --replica-groups N`` as overrides, plus the group's own output directory
    (RUN_DIR/replica-group-I: each group logs, locks and checkpoints apart)."""
    if args.replica_group is None and args.replica_groups is None:
        return []
    if args.replica_group is None or args.replica_groups is None:
        given, missing = ("--replica-group", "--replica-groups")[:: 1 if args.replica_group is not None else -1]
        raise ConfigError(
            f"{given} needs {missing} beside it: start each group with --replica-group I --replica-groups N"
        )
    output_dir = load_config(args.config, args.overrides).run.output_dir
    return [
        f"parallel.fault_tolerance.replica_group={args.replica_group}",
        f"parallel.fault_tolerance.replica_groups={args.replica_groups}",
        f"run.output_dir={output_dir / f'replica-group-{args.replica_group}'}",
    ]


def lighthouse_command(args: argparse.Namespace) -> int:
    from paratrain.launch.replica_groups import run_lighthouse  # lazy: loads torchft

    return run_lighthouse(
        bind=args.bind,
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )


def maybe_holding_run_lock(output_dir: Path, *, node_rank: int) -> AbstractContextManager:
    """This process holds output_dir's run lock on node 0 (see paratrain.launch.run_lock); other nodes'
    launchers hold none, since the directory is shared."""
    from paratrain.launch.run_lock import holding_run_lock  # lazy: as every command's imports

    if node_rank != 0:
        return nullcontext()
    return holding_run_lock(
        output_dir, pid=os.getpid(), say=lambda notice: print(f"paratrain: warning: {notice}", file=sys.stderr)
    )


def run_or_launch(
    config: Config, dims: ParallelDims, options: LaunchOptions, args: argparse.Namespace, *, auto: bool
) -> int:
    """Trains in this process (one process, no restarts), or launches the workers under torchrun."""
    # lazy: each command loads only what it runs, so every `paratrain` call starts fast
    from paratrain.checks.preflight import PREFLIGHT_DONE_ENV
    from paratrain.planner.layouts import layout_overrides

    # Replica groups always run under torchrun: torchft's managers meet in the group's store.
    if options.world_size == 1 and options.max_restarts == 0 and not dims.ft_enabled:
        # lazy: each command loads only what it runs, so every `paratrain` call starts fast
        from paratrain.train import configure_logging, freeze_imported_objects, run

        configure_logging(rank=0)
        freeze_imported_objects()
        run(config, config_path=args.config)
        return maybe_export_final_hf(config, node_rank=0)
    # lazy: each command loads only what it runs, so every `paratrain` call starts fast
    from paratrain.launch.launcher import launch

    maybe_check_memory_before_launch(config, dims, options, config_path=args.config)
    # The layout auto chose, given explicitly: workers train it without ranking layouts again.
    chosen = layout_overrides(dims) if auto else []
    code = launch(options, [args.config, *args.overrides, *chosen], env={PREFLIGHT_DONE_ENV: "1"})
    return maybe_export_final_hf(config, node_rank=options.node_rank) if code == 0 else code


def maybe_export_final_hf(config: Config, *, node_rank: int) -> int:
    """checkpoint.save_final_hf: the finished run's last checkpoint as a Hugging Face directory, written once
    (by the first node's launcher) after every worker has exited, so no worker holds more memory for it."""
    if not config.checkpoint.save_final_hf or node_rank != 0:
        return 0
    # lazy: each command loads only what it runs, so every `paratrain` call starts fast
    from paratrain.checkpoint import Checkpointer
    from paratrain.tools.export import export_hf

    checkpoints = config.run.output_dir / "checkpoints"
    latest = Checkpointer(checkpoints, keep_last=None, rank=0, world_size=1, config={}).latest_verified()
    if latest is None:
        print(f"paratrain: error: checkpoint.save_final_hf: no checkpoint in {checkpoints} to export", file=sys.stderr)
        return 1
    out_dir = config.run.output_dir / "hf"
    count = export_hf(latest, out_dir)
    kind = "its LoRA adapter (peft's format)" if config.model.lora is not None else "a Hugging Face model"
    print(f"paratrain: wrote {latest.name} as {kind} to {out_dir} ({count} tensors)", file=sys.stderr)
    return 0


def maybe_check_memory_before_launch(
    config: Config, dims: ParallelDims, options: LaunchOptions, *, config_path: str
) -> None:
    """On CPU the node's processes share its RAM, so the memory check runs here, once, before any worker
    starts: a refusal costs no launch and is printed by one process. GPU runs check in each worker, whose
    own device's free memory is what counts (train.run)."""
    # Lazy: both load torch, which the CLI imports only once the config parses.
    from paratrain.launch.process_group import pick_device
    from paratrain.planner.memory_check import check_memory

    if pick_device(config.train.device, 0).type != "cpu":
        return
    verdict = check_memory(
        config, dims, rank=0, local_rank=0, local_world_size=options.nproc_per_node, config_path=config_path
    )
    if verdict:  # this process's logging is not configured: the workers' is
        print(f"paratrain: {verdict}", file=sys.stderr)


def checkpoint_check_command(args: argparse.Namespace) -> int:
    args.checkpoint = str(named_checkpoint(Path(args.checkpoint)))
    options = LaunchOptions(args.nproc_per_node, 1, 0, None, 0)
    options.validate()
    if args.nproc_per_node == 1:
        from paratrain.tools.checkpoint_check import check_checkpoint  # lazy: loads the trainer
        from paratrain.train import configure_logging

        configure_logging(rank=0)
        print(check_checkpoint(Path(args.checkpoint), args.overrides))
        return 0
    from paratrain.launch.launcher import launch  # lazy: torchrun's modules

    worker = "paratrain.tools.checkpoint_check"
    return launch(options, [args.checkpoint, *args.overrides], env={}, worker_module=worker)


def dry_run_command(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    # lazy: each command loads only what it runs, so every `paratrain` call starts fast
    from paratrain.planner.dry_run import dry_run  # loads torch.distributed
    from paratrain.planner.memory_check import maybe_resolve_auto  # Lazy: loads torch, as dry_run does

    nnodes = args.nnodes or 1
    config = maybe_resolve_auto(config, world_size=args.nproc_per_node * nnodes, nproc_per_node=args.nproc_per_node)

    print(dry_run(config, nproc_per_node=args.nproc_per_node, nnodes=nnodes))
    return 0


def config_show_command(args: argparse.Namespace) -> int:
    print(config_to_yaml(load_config(args.config, args.overrides)), end="")
    return 0


def export_command(args: argparse.Namespace) -> int:
    # lazy: each command loads only what it runs, so every `paratrain` call starts fast
    from paratrain.tools.export import export_hf, export_safetensors  # keeps safetensors off the training path

    checkpoint = named_checkpoint(Path(args.checkpoint))
    if args.merge and not args.hf:
        raise ConfigError("--merge writes a Hugging Face model directory: give it with --hf OUT_DIR")
    if args.hf:
        if Path(args.hf).is_file():
            raise ConfigError(f"--hf {args.hf} is a file: give the directory to write the Hugging Face model into")
        count = export_hf(checkpoint, Path(args.hf), merge=args.merge)
        print(
            f"wrote {checkpoint.name}: {count} tensors and their config to {args.hf} (transformers' from_pretrained "
            f"loads it; a LoRA run's adapter, without --merge, peft's PeftModel.from_pretrained onto the base)"
        )
    else:
        if Path(args.out).is_dir():
            raise ConfigError(
                f"--out {args.out} is a directory: give the file to write, e.g. --out "
                f"{Path(args.out) / 'model.safetensors'} (or --hf {args.out} for a Hugging Face model directory)"
            )
        count = export_safetensors(checkpoint, Path(args.out))
        print(f"wrote {checkpoint.name}: {count} tensors to {args.out}")
    return 0


def pipeline_show_command(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    # lazy: each command loads only what it runs, so every `paratrain` call starts fast
    from paratrain.tools.pipeline_show import show_pipeline  # loads torch.distributed.pipelining and matplotlib

    out = Path(args.out) if args.out else config.run.output_dir / "pipeline" / "schedule.png"
    print(
        show_pipeline(
            config,
            world_size=args.nproc_per_node * args.nnodes,
            nproc_per_node=args.nproc_per_node,
            out=out,
            run_dir=Path(args.run) if args.run else None,
        )
    )
    return 0


def report_command(args: argparse.Namespace) -> int:
    # lazy: each command loads only what it runs, so every `paratrain` call starts fast
    from paratrain.tools.report import NO_MEMORY, write_report  # loads matplotlib

    runs = [Path(run) for run in args.runs]
    report = write_report(runs, out=Path(args.out) if args.out else runs[0] / "report")
    for plot in report.plots:
        print(f"wrote {plot}")
    if not report.memory_keys:
        print(NO_MEMORY)
    print(f"wrote {report.html}")
    return 0


def bench_comm_command(args: argparse.Namespace) -> int:
    # lazy: each command loads only what it runs, so every `paratrain` call starts fast
    from paratrain.tools.bench_comm import run_benchmark  # loads torch.distributed and matplotlib

    bench = run_benchmark(
        nproc_per_node=args.nproc_per_node,
        sizes=args.sizes,
        iters=args.iters,
        warmup=args.warmup,
        device=args.device,
        out=Path(args.out),
    )
    return 0 if bench else 1


def verify_command(args: argparse.Namespace) -> int:
    # lazy: each command loads only what it runs, so every `paratrain` call starts fast
    from paratrain.tools.verify import verify

    return verify(args.config, args.overrides, nproc_per_node=args.nproc_per_node, steps=args.steps)


def slurm_command(args: argparse.Namespace) -> int:

    # lazy: each command loads only what it runs, so every `paratrain` call starts fast
    from paratrain.launch.slurm import SlurmJob, render_sbatch

    config = load_config(args.config, args.overrides)  # bad overrides are refused here, not on the cluster
    job = SlurmJob(
        config=Path(args.config).resolve(),
        overrides=tuple(args.overrides),
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        job_name=config.run.name,
        output_dir=config.run.output_dir.resolve(),
        time=args.time,
        partition=args.partition,
        device=args.device,
    )
    job.validate()
    if args.submit and shutil.which("sbatch") is None:
        raise ConfigError("--submit needs Slurm's sbatch on PATH: run on a Slurm login node, or drop --submit")
    script = Path(args.out) if args.out else job.output_dir / "slurm.sbatch"
    if script.is_dir():
        raise ConfigError(
            f"--out {args.out} is a directory: give the script's file name, e.g. --out {script / 'job.sbatch'}"
        )
    script.parent.mkdir(parents=True, exist_ok=True)
    job.output_dir.mkdir(parents=True, exist_ok=True)  # Slurm writes slurm-<job>.out there and creates no folder
    script.write_text(render_sbatch(job, workdir=Path.cwd()))
    print(f"wrote {script}")
    if args.submit:
        submitted = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
        if submitted.returncode != 0:
            print(f"paratrain: sbatch failed: {submitted.stderr.strip()}", file=sys.stderr)
            return submitted.returncode
        print(f"submitted job {submitted.stdout.strip().split(';')[0]}")
    return 0


def plan_command(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    # lazy: each command loads only what it runs, so every `paratrain` call starts fast
    from paratrain.planner.command import plan_command_text  # loads torch

    text, code = plan_command_text(
        config, config_path=args.config, gpus=args.gpus, gpu_memory=args.gpu_memory, nodes=args.nodes
    )
    print(text)
    return code


def add_config_arguments(
    parser: argparse.ArgumentParser, *, overrides_help: str = "dotted config overrides, as for train"
) -> None:
    """The YAML file and its ``key=value`` overrides, as every command that reads a config takes them."""
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=overrides_help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paratrain", description="PyTorch-native distributed training.")
    commands = parser.add_subparsers(dest="command", required=True)
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
        add_parser(commands)
    return parser


def add_train_parser(commands: argparse._SubParsersAction) -> None:
    """``paratrain train CONFIG [key=value ...]``: one process, torchrun workers, or ``--dry-run``."""
    train = commands.add_parser("train", help="train from a YAML config")
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
    train.set_defaults(handler=train_command)


def add_lighthouse_parser(commands: argparse._SubParsersAction) -> None:
    """``paratrain lighthouse``: torchft's quorum server, which every replica group joins."""
    lighthouse = commands.add_parser(
        "lighthouse", help="serve the quorum of fault-tolerant replica groups (torchft's lighthouse)"
    )
    lighthouse.add_argument(
        "--bind",
        default="127.0.0.1:29510",
        help="HOST:PORT to listen on (default loopback; a cluster: the node's address)",
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
    lighthouse.set_defaults(handler=lighthouse_command)


def add_config_parser(commands: argparse._SubParsersAction) -> None:
    """``paratrain config show CONFIG``: the resolved config."""
    config = commands.add_parser("config", help="inspect configs")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser("show", help="print the fully resolved config")
    add_config_arguments(show)
    show.set_defaults(handler=config_show_command)


def add_export_parser(commands: argparse._SubParsersAction) -> None:
    """``paratrain export CHECKPOINT --out FILE | --hf DIR``: consolidated weights."""
    export = commands.add_parser("export", help="write consolidated model weights from a checkpoint")
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
    export.set_defaults(handler=export_command)


def add_pipeline_parser(commands: argparse._SubParsersAction) -> None:
    """``paratrain pipeline show CONFIG``: each rank's schedule and its bubble."""
    pipeline = commands.add_parser("pipeline", help="inspect pipeline schedules")
    pipeline_commands = pipeline.add_subparsers(dest="pipeline_command", required=True)
    pipeline_show = pipeline_commands.add_parser(
        "show", help="print each rank's schedule timeline and bubble, and draw it as a PNG"
    )
    add_config_arguments(pipeline_show)
    pipeline_show.add_argument("--nproc-per-node", type=int, default=1, help="processes per node, as for train")
    pipeline_show.add_argument("--nnodes", type=int, default=1, help="number of nodes, as for train")
    pipeline_show.add_argument("--out", help="PNG path (default: OUTPUT_DIR/pipeline/schedule.png)")
    pipeline_show.add_argument("--run", help="run directory whose recorded timelines to measure (default: OUTPUT_DIR)")
    pipeline_show.set_defaults(handler=pipeline_show_command)


def add_report_parser(commands: argparse._SubParsersAction) -> None:
    """``paratrain report RUN_DIR ...``: plots and one HTML page."""
    report = commands.add_parser("report", help="plot runs' metrics (PNG) and write one self-contained HTML page")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run output directories, overlaid in every plot")
    report.add_argument("--out", help="output directory (default: the first RUN_DIR/report)")
    report.set_defaults(handler=report_command)


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    """``paratrain bench comm``: collectives over a size sweep."""
    bench = commands.add_parser("bench", help="micro-benchmarks")
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
    comm.set_defaults(handler=bench_comm_command)


def add_verify_parser(commands: argparse._SubParsersAction) -> None:
    """``paratrain verify CONFIG``: the layout against one process, loss by loss."""
    verify = commands.add_parser(
        "verify", help="train the config's layout and one process for a few steps and compare losses"
    )
    add_config_arguments(verify)
    verify.add_argument(
        "--nproc-per-node", type=int, help="processes for the layout (default: 2, or 1 for single, dp, model_parallel)"
    )
    verify.add_argument("--steps", type=int, default=20, help="optimizer steps each run trains (default 20)")
    verify.set_defaults(handler=verify_command)


def add_slurm_parser(commands: argparse._SubParsersAction) -> None:
    """``paratrain slurm CONFIG --nodes N --gpus-per-node G``: an sbatch script."""
    slurm = commands.add_parser(
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
    slurm.add_argument("--out", help="script path (default: OUTPUT_DIR/slurm.sbatch)")
    slurm.add_argument("--submit", action="store_true", help="submit the script with sbatch")
    slurm.set_defaults(handler=slurm_command)


def add_checkpoint_parser(commands: argparse._SubParsersAction) -> None:
    """``paratrain checkpoint check CHECKPOINT [key=value ...]``: load under a layout without training."""
    checkpoint = commands.add_parser("checkpoint", help="inspect checkpoints")
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
    check.set_defaults(handler=checkpoint_check_command)


def add_plan_parser(commands: argparse._SubParsersAction) -> None:
    """``paratrain plan CONFIG --gpus N --gpu-memory SIZE``: every layout ranked."""
    plan = commands.add_parser(
        "plan", help="memory per GPU of every layout a cluster allows, ranked, with a recommendation"
    )
    add_config_arguments(plan)
    plan.add_argument("--gpus", type=int, required=True, help="GPUs in the cluster (all nodes)")
    plan.add_argument("--gpu-memory", required=True, help="memory per GPU, e.g. 80GB (10^9 B) or 80GiB (2^30 B)")
    plan.add_argument(
        "--nodes", type=int, default=1, help="nodes the GPUs are spread over evenly (tensor parallel stays in one)"
    )
    plan.set_defaults(handler=plan_command)


if __name__ == "__main__":
    sys.exit(main())
