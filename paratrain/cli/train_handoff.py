"""``paratrain train``: the config checked once (``prepare_run``), the run lock held, then the run trained in
this process (one process) or handed to torchrun workers, and a finished run's ``save_final_hf`` export.

What a launcher process imports is what it needs to check and launch: torch and the planner, never DTensor,
DCP or FSDP, which only the workers (or a one-process run) load. Lazy imports: the trainer (a one-process run)
and the exporter (a run that exports), each marked where it stands."""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from paratrain.checks.preflight import PREFLIGHT_DONE_ENV
from paratrain.cli.commands import dry_run_command
from paratrain.config.loading import load_config
from paratrain.config.schema import Config
from paratrain.errors import ConfigError
from paratrain.launch.gc_pause import collections_paused
from paratrain.launch.launcher import LaunchOptions, launch
from paratrain.launch.lighthouse import REPLICA_GROUP_PRELOAD, check_lighthouse_reachable, replica_group_environment
from paratrain.launch.process_group import pick_device
from paratrain.launch.rank_logging import configure_logging
from paratrain.launch.run_lock import holding_run_lock
from paratrain.launch.slurm import apply_slurm_environment
from paratrain.parallel.dims import ParallelDims
from paratrain.planner.layouts import layout_overrides
from paratrain.planner.memory_check import check_memory
from paratrain.training.preparation import prepare_run


def train_command(args: argparse.Namespace) -> int:
    """``paratrain train``: checks the config once, holds the run lock, then trains or launches."""
    options = LaunchOptions(
        args.nproc_per_node, args.nnodes or 1, args.node_rank, args.rdzv_endpoint, args.max_restarts
    )
    # Inside an srun step every node runs this same command: Slurm says which node this is.
    options = apply_slurm_environment(
        options, os.environ, nnodes_given=args.nnodes is not None, replica_group=args.replica_group
    )
    if args.skip_memory_check:  # an override, so workers the launcher starts skip it too
        args.overrides = [*args.overrides, "train.check_memory=false"]
    args.overrides = [*args.overrides, *replica_group_overrides(args)]
    if args.dry_run:  # before options.validate(): planning a multi-node world needs no rendezvous endpoint
        return dry_run_command(args)
    options.validate()
    prepared = prepare_run(
        args.config, args.overrides, world_size=options.world_size, nproc_per_node=options.nproc_per_node
    )
    if prepared.auto_choice:
        print(f"paratrain: {prepared.auto_choice}", file=sys.stderr)
    for warning in prepared.warnings:
        print(f"paratrain: warning: {warning}", file=sys.stderr)
    config, dims = prepared.config, prepared.dims
    if dims.ft_enabled:
        check_lighthouse_reachable(config.parallel.fault_tolerance)
    # One run per output directory, held by node 0's launcher (or the one process) until it exits.
    with maybe_holding_run_lock(config.run.output_dir, node_rank=options.node_rank):
        return run_or_launch(config, dims, options, args, auto=prepared.auto_choice is not None)


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


def maybe_holding_run_lock(output_dir: Path, *, node_rank: int) -> AbstractContextManager:
    """This process holds output_dir's run lock on node 0 (see paratrain.launch.run_lock); other nodes'
    launchers hold none, since the directory is shared."""
    if node_rank != 0:
        return nullcontext()
    return holding_run_lock(
        output_dir, pid=os.getpid(), say=lambda notice: print(f"paratrain: warning: {notice}", file=sys.stderr)
    )


def run_or_launch(
    config: Config, dims: ParallelDims, options: LaunchOptions, args: argparse.Namespace, *, auto: bool
) -> int:
    """Trains in this process (one process, no restarts), or launches the workers under torchrun."""
    # Replica groups always run under torchrun: torchft's managers meet in the group's store.
    if options.world_size == 1 and options.max_restarts == 0 and not dims.ft_enabled:
        with collections_paused():  # ~300k objects imported, none of them garbage (paratrain.launch.gc_pause)
            from paratrain.train import freeze_imported_objects, run  # lazy: the trainer's DTensor, DCP and FSDP

        configure_logging(rank=0)
        freeze_imported_objects()
        run(config, config_path=args.config)
        return maybe_export_final_hf(config, node_rank=0)
    maybe_check_memory_before_launch(config, dims, options, config_path=args.config)
    # The layout auto chose, given explicitly: workers train it without ranking layouts again.
    chosen = layout_overrides(dims) if auto else []
    env = {PREFLIGHT_DONE_ENV: "1", **(replica_group_environment() if dims.ft_enabled else {})}
    preload = REPLICA_GROUP_PRELOAD if dims.ft_enabled else ()
    code = launch(options, [args.config, *args.overrides, *chosen], env=env, preload=preload)
    return maybe_export_final_hf(config, node_rank=options.node_rank) if code == 0 else code


def maybe_export_final_hf(config: Config, *, node_rank: int) -> int:
    """checkpoint.save_final_hf: the finished run's last checkpoint as a Hugging Face directory, written once
    (by the first node's launcher) after every worker has exited, so no worker holds more memory for it."""
    if not config.checkpoint.save_final_hf or node_rank != 0:
        return 0
    from paratrain.tools.export import export_newest_hf  # lazy: DCP's reader, only for runs that export

    checkpoints, out_dir = config.run.output_dir / "checkpoints", config.run.output_dir / "hf"
    exported = export_newest_hf(checkpoints, out_dir)
    if exported is None:
        print(f"paratrain: error: checkpoint.save_final_hf: no checkpoint in {checkpoints} to export", file=sys.stderr)
        return 1
    latest, count = exported
    kind = "its LoRA adapter (peft's format)" if config.model.lora is not None else "a Hugging Face model"
    print(f"paratrain: wrote {latest.name} as {kind} to {out_dir} ({count} tensors)", file=sys.stderr)
    return 0


def maybe_check_memory_before_launch(
    config: Config, dims: ParallelDims, options: LaunchOptions, *, config_path: str
) -> None:
    """On CPU the node's processes share its RAM, so the memory check runs here, once, before any worker
    starts: a refusal costs no launch and is printed by one process. GPU runs check in each worker, whose
    own device's free memory is what counts (train.run)."""
    if pick_device(config.train.device, 0).type != "cpu":
        return
    verdict = check_memory(
        config, dims, rank=0, local_rank=0, local_world_size=options.nproc_per_node, config_path=config_path
    )
    if verdict:  # this process's logging is not configured: the workers' is
        print(f"paratrain: {verdict}", file=sys.stderr)
