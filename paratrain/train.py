"""Per-rank entry point: config -> checks -> Trainer(...).train().

``paratrain train`` runs it in-process for one process and through torchrun for more; users may also
start it under torchrun themselves: ``torchrun --nproc-per-node 2 -m paratrain.train CONFIG [k=v ...]``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from paratrain.checks.preflight import PREFLIGHT_DONE_ENV
from paratrain.config.schema import Config
from paratrain.errors import EXIT_GROUP_RESTART, EXIT_USER_ERROR, RUN_ENDINGS, exit_code_of
from paratrain.launch.process_group import local_world_size_from_env, pick_device, world_size_from_env
from paratrain.launch.rank_logging import configure_logging
from paratrain.launch.run_lock import holding_run_lock, worker_lock_pid
from paratrain.parallel.dims import resolve_parallel_dims
from paratrain.planner.memory_check import check_memory
from paratrain.training.preparation import prepare_run
from paratrain.training.trainer import Trainer, TrainResult


def run(config: Config, *, config_path: str = "CONFIG") -> TrainResult:
    """Trains the config's model, data and loss in this process (one rank of the job).

    Args:
        config_path: How the user named the config, for the command a refused memory check suggests.
    """
    check_memory_before_allocating(config, config_path=config_path)
    trainer = Trainer(config)
    try:
        return trainer.train()
    finally:
        trainer.close()
        # The Trainer sits in reference cycles with its meshes, which hold its process groups: collected
        # now, while the interpreter is whole, instead of in its teardown, where destroying gloo groups
        # aborted a finished run ("terminate called without an active exception", pytorch#179291).
        del trainer
        gc.collect()


def check_memory_before_allocating(config: Config, *, config_path: str) -> None:
    """Every GPU rank compares the planner's estimate with its own device's free memory before the model
    exists. On CPU the node's processes share the RAM: the CLI checked for all of them before launching,
    and a rank reading MemAvailable after another rank allocated would refuse a layout that fits, so
    only local rank 0 checks, and only when the CLI did not."""
    local, local_rank = local_world_size_from_env(), int(os.environ.get("LOCAL_RANK", 0))
    on_cpu = pick_device(config.train.device, local_rank).type == "cpu"
    if on_cpu and (os.environ.get(PREFLIGHT_DONE_ENV) or local_rank != 0):
        return
    dims = resolve_parallel_dims(config.parallel, world_size=world_size_from_env(), local_world_size=local)
    check_memory(
        config,
        dims,
        rank=int(os.environ.get("RANK", 0)),
        local_rank=local_rank,
        local_world_size=local,
        config_path=config_path,
    )


def freeze_imported_objects() -> None:
    """Moves every object alive now (torch's, the model's and the other imports', ~300k) out of the garbage collector's
    reach, so the collections during training and Trainer.close's ``gc.collect`` only walk what the run
    made: that collect took a third of a tiny run (0.34 of 1.1 s), most of it walking modules that are
    never garbage. Only for a process that exists to train: cycles among objects alive now are never freed.
    """
    gc.freeze()


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    configure_logging(rank)
    logger = logging.getLogger("paratrain")
    try:
        # Rank 0 checks the config, unless the paratrain launcher did before starting the workers.
        prepared = prepare_run(
            args.config,
            args.overrides,
            world_size=world_size_from_env(),
            nproc_per_node=local_world_size_from_env(),
            check=rank == 0 and not os.environ.get(PREFLIGHT_DONE_ENV),
        )
        if prepared.auto_choice:
            logger.info("%s", prepared.auto_choice)
        for warning in prepared.warnings:
            logger.warning("warning: %s", warning)
        with maybe_holding_run_lock(prepared.config.run.output_dir):
            freeze_imported_objects()  # after preflight, which imported the model's modules
            run(prepared.config, config_path=args.config)
    except RUN_ENDINGS as error:
        # A stop (preempted, non-finite, a failed save) was reported by the Trainer before any rank could exit;
        # a replica group's restart is said by each rank it ends, which may be one rank alone.
        code = exit_code_of(error)
        if code == EXIT_USER_ERROR:
            report_user_error(error, rank=rank)
        elif code == EXIT_GROUP_RESTART:
            logger.error("%s", error)
        return code
    return 0


def maybe_holding_run_lock(output_dir: Path) -> AbstractContextManager:
    """The run lock on output_dir, held by global rank 0 when no paratrain launcher holds it (see
    paratrain.launch.run_lock); nothing on other ranks."""
    pid = worker_lock_pid(os.environ)
    if pid is None:
        return nullcontext()
    return holding_run_lock(output_dir, pid=pid, say=logging.getLogger("paratrain").warning)


def report_user_error(error: Exception, *, rank: int) -> None:
    """The message alone, on rank 0's stderr: it already names the key and the fix."""
    if rank == 0:
        print(f"paratrain: error: {error}", file=sys.stderr, flush=True)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m paratrain.train", description="One rank of a paratrain job.")
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
