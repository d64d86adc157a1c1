"""Checkpoint loads run on every rank of the session's pool (see rank_pool.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from paratrain.checkpoint import Checkpointer
from paratrain.checkpoint.policy import choose_resume, load_resume
from paratrain.checkpoint.safe_reader import SafeFileSystemReader
from paratrain.checkpoint.state import Progress
from paratrain.config.schema import CheckpointConfig


@dataclass
class OwnShard(Stateful):
    """A tensor only this rank saves and loads: its file is read by this rank alone."""

    rank: int
    value: torch.Tensor

    def state_dict(self) -> dict:
        return {f"rank{self.rank}": self.value}

    def load_state_dict(self, state_dict: dict) -> None:
        self.value = state_dict[f"rank{self.rank}"]


def state(rank: int, step: int) -> dict:
    return {"own": OwnShard(rank, torch.full((1024,), float(step))), "progress": Progress(step)}


def resume_with_one_ranks_file_damaged(directory: str, damaged_rank: int) -> dict:
    """Saves steps 1 and 2, flips a byte in the step-2 file only ``damaged_rank`` reads, then resumes as a
    run does; returns what this rank chose, loaded, and holds."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    checkpointer = Checkpointer(Path(directory), keep_last=None, rank=rank, world_size=world_size, config={})
    for step in (1, 2):
        checkpointer.save(step, state(rank, step))
    if rank == 0:
        flip_a_byte_of(checkpointer.directory / "step-2", f"own.rank{damaged_rank}")
    dist.barrier()
    into, options = state(rank, 99), CheckpointConfig()
    chosen = choose_resume(checkpointer, options, config={}, is_main=rank == 0)
    loaded = load_resume(checkpointer, chosen, into, options=options, config={}, is_main=rank == 0, optional=())
    return {
        "chosen": chosen.name,
        "loaded": loaded.name,
        "values": sorted(set(into["own"].value.tolist())),
        "step": into["progress"].step,
    }


def flip_a_byte_of(checkpoint: Path, fqn: str) -> None:
    """Flips a byte inside the saved bytes of ``fqn``: its file's size stays, its checksum does not."""
    stored = next(
        info
        for index, info in SafeFileSystemReader(checkpoint).read_metadata().storage_data.items()
        if index.fqn == fqn
    )
    path = checkpoint / stored.relative_path
    data = bytearray(path.read_bytes())
    data[stored.offset + stored.length // 2] ^= 0xFF
    path.write_bytes(bytes(data))
