"""``paratrain checkpoint check CKPT [key=value ...] [--nproc-per-node N]``: does a checkpoint load under a
layout, before renting the machines for it?

The check builds what a resume builds: the checkpoint's own config (from its manifest) with the
overrides, the same checks of what changed that a resume makes, the same Trainer (mesh, model laid
out, optimizer), then loads the checkpoint's model and optimizer state through the same
``Checkpointer.load``. Every rank then reads back the saved values of the pieces it holds and compares
them with what it loaded, so a load that succeeds with wrong values fails the check. Nothing trains and nothing is written beside the checkpoint's run: the Trainer's
output directory is a scratch one. Rank 0 then says what moved: the layout and world size it was saved
under and the one it loaded into, and for a few parameters how their saved pieces map to this rank's.
Run per rank: in this process for one, under paratrain's launcher (``python -m
paratrain.tools.checkpoint_check``) for more.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from paratrain.checkpoint.manifest import read_manifest
from paratrain.checkpoint.safe_reader import SafeFileSystemReader
from paratrain.checkpoint.tensor_reader import TensorReader
from paratrain.config.loading import load_config
from paratrain.config.schema import Config, ParallelConfig
from paratrain.errors import EXIT_USER_ERROR, CheckpointError, ConfigError, UserCodeError
from paratrain.launch.rank_logging import configure_logging
from paratrain.models.pretrained import local_region
from paratrain.parallel.collectives import all_reduce_sum
from paratrain.parallel.dims import resolve_parallel_dims
from paratrain.training.trainer import Trainer

logger = logging.getLogger("paratrain")
SHOWN_PARAMETERS = 5


def check_config(checkpoint: Path, overrides: list[str], scratch: Path) -> Config:
    """The checkpoint's own config with the overrides, resuming from it into a scratch output directory."""
    saved = read_manifest(checkpoint).get("config")
    if not saved:
        raise CheckpointError(f"{checkpoint}: its manifest holds no config to rebuild the run from")
    config_file = scratch / "saved-config.yaml"
    config_file.write_text(yaml.safe_dump(saved))
    return load_config(
        config_file, [*overrides, f"checkpoint.resume={checkpoint}", f"run.output_dir={scratch / 'run'}"]
    )


def check_checkpoint(checkpoint: Path, overrides: list[str]) -> str:
    """Loads the checkpoint under the layout; returns rank 0's report (empty on other ranks).

    Raises:
        CheckpointError: naming what does not load (a name, a shape), from DCP's own message.
    """
    with tempfile.TemporaryDirectory(prefix="paratrain-check-") as scratch:
        config = check_config(checkpoint, overrides, Path(scratch))
        trainer = Trainer(config)
        try:
            try:
                trainer.checkpoints.load(checkpoint)
            except (ConfigError, CheckpointError):
                raise
            except (Exception, CheckpointException) as error:  # DCP's planner names the key or shape
                raise CheckpointError(
                    f"{checkpoint} does not load under {trainer.dims.describe_layout()}: {cause(error)}"
                ) from None
            compared = require_loaded_equals_saved(checkpoint, trainer)
            return report(checkpoint, trainer, compared) if trainer.ctx.is_main else ""
        finally:
            trainer.close()


@dataclass
class Comparison:
    """This rank's loaded tensors against the saved values of the same pieces."""

    compared: int = 0
    not_compared: int = 0  # strided shards (fsdp over tp): not one block of the saved tensor
    differing: list[str] = field(default_factory=list)


def require_loaded_equals_saved(checkpoint: Path, trainer: Trainer) -> Comparison:
    """Compares on every rank, then agrees: raises on every rank if any rank's values differ.

    Raises:
        CheckpointError: naming the first few pieces that differ on this rank.
    """
    comparison = compare_with_saved(checkpoint, trainer)
    counts = torch.tensor([len(comparison.differing), comparison.compared], device=trainer.ctx.device)
    differing, compared = (int(value) for value in all_reduce_sum(counts).tolist())
    if differing:
        here = ", ".join(comparison.differing[:3]) or "none on this rank"
        raise CheckpointError(
            f"{checkpoint} loads under {trainer.dims.describe_layout()}, but {differing} of {compared} tensor pieces "
            f"differ from the saved values (e.g. {here}): the load is wrong; please report it with this checkpoint"
        )
    comparison.compared = compared
    return comparison


def compare_with_saved(checkpoint: Path, trainer: Trainer) -> Comparison:
    """Every model and optimizer tensor this rank loaded against the checkpoint's values for the region it
    holds, each saved tensor read back whole, one at a time (not checked against the manifest again: the load
    just did)."""
    state = trainer.checkpoint_state()
    loaded = {
        **_tensors("model", state["model"].state_dict()),
        **_tensors("optimizer", state["optimizer"].state_dict()),
    }
    comparison = Comparison()
    with TensorReader(checkpoint, verify=False) as reader:
        saved = reader.tensors("")
        for key, expected in reader.read(key for key in loaded if key in saved):
            piece = _piece_of(loaded[key], expected)
            if piece is None:
                comparison.not_compared += 1
                continue
            comparison.compared += 1
            if not torch.equal(piece[0].detach().cpu().to(expected.dtype), piece[1]):
                comparison.differing.append(key)
    return comparison


def _tensors(name: str, state: dict) -> dict[str, torch.Tensor]:
    # DCP's keys: the Stateful's name, then its state dict's (already flat) keys.
    return {f"{name}.{key}": value for key, value in state.items() if isinstance(value, torch.Tensor)}


def _piece_of(loaded: torch.Tensor, saved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(what this rank holds, the same region of the saved tensor), or None for a strided shard."""
    if not isinstance(loaded, DTensor):
        return loaded, saved
    region = local_region(loaded)
    return None if region is None else (loaded.to_local(), saved[region])


def _saved_tensor_items(checkpoint: Path) -> dict[str, TensorStorageMetadata]:
    metadata = SafeFileSystemReader(checkpoint).read_metadata().state_dict_metadata
    return {key: item for key, item in metadata.items() if isinstance(item, TensorStorageMetadata)}


def report(checkpoint: Path, trainer: Trainer, comparison: Comparison) -> str:
    manifest = read_manifest(checkpoint)
    saved_world = int(manifest.get("world_size", 1))
    saved_parallel = ParallelConfig(**manifest["config"].get("parallel", {}))
    saved_layout = resolve_parallel_dims(saved_parallel, world_size=saved_world).describe_layout()
    parameters = dict(trainer.bare_model.named_parameters())
    groups = trainer.optimizer.param_groups
    lines = [
        f"{checkpoint}: step {trainer.progress.step}, saved by {saved_world} process(es) as {saved_layout}",
        f"loads as {trainer.dims.describe_layout()} on {trainer.ctx.world_size} process(es): "
        f"{len(parameters)} parameter tensors ({sum(p.numel() for p in parameters.values()):,} values) and the "
        f"optimizer state of {len(trainer.optimizer.state)} of them in {len(groups)} param group(s)",
        f"loaded values: {comparison.compared} tensor pieces over all ranks equal the saved ones"
        + (f" ({comparison.not_compared} strided pieces on rank 0 not compared)" if comparison.not_compared else ""),
        "what moved (saved pieces -> this layout, rank 0):",
    ]
    saved_chunks = {key: len(item.chunks) for key, item in _saved_tensor_items(checkpoint).items()}
    for name, parameter in list(parameters.items())[:SHOWN_PARAMETERS]:
        pieces = saved_chunks.get(f"model.{name}", "?")
        lines.append(f"  {name} {list(parameter.shape)}: saved in {pieces} piece(s) -> {placement(parameter)}")
    if len(parameters) > SHOWN_PARAMETERS:
        lines.append(f"  ... and {len(parameters) - SHOWN_PARAMETERS} more")
    return "\n".join(lines)


def placement(parameter: torch.Tensor) -> str:
    if isinstance(parameter, DTensor):
        local = list(parameter.to_local().shape)
        return (
            f"{', '.join(str(p) for p in parameter.placements)} over {parameter.device_mesh.size()} ranks, {local} here"
        )
    return "whole on every rank that holds it"


def cause(error: BaseException) -> str:
    """The first line of the error, or of the first rank's error a CheckpointException gathered (its own
    text is a traceback per rank)."""
    if isinstance(error, CheckpointException) and error.failures:
        error, _ = next(iter(error.failures.values()))
    text = str(error).strip() or type(error).__name__
    return next(line.strip() for line in text.splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
    """One rank of the check (the CLI launches this module for several processes)."""
    parser = argparse.ArgumentParser(prog="python -m paratrain.tools.checkpoint_check")
    parser.add_argument("checkpoint")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    configure_logging(rank)
    try:
        text = check_checkpoint(Path(args.checkpoint), args.overrides)
    except (ConfigError, CheckpointError, UserCodeError) as error:
        if rank == 0:
            print(f"paratrain: error: {error}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    if text:
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
