"""Checkpoints through torch.distributed.checkpoint (DCP), with completion markers and checksums."""

from paratrain.checkpoint.checkpointer import Checkpointer, find_checkpoints
from paratrain.checkpoint.manifest import verify_checkpoint

__all__ = ["Checkpointer", "find_checkpoints", "verify_checkpoint"]
