"""Checkpoints through torch.distributed.checkpoint (DCP), with completion markers and checksums.

``Checkpointer`` loads DCP, so it is imported on first use: the CLI's checks before launching only
need the manifest side (``find_checkpoints``, ``verify_checkpoint``).
"""

from paratrain.checkpoint.manifest import find_checkpoints, verify_checkpoint

__all__ = ["Checkpointer", "find_checkpoints", "verify_checkpoint"]


def __getattr__(name: str):
    if name == "Checkpointer":
        # Lazy: DCP is a second of start-up the CLI's pre-launch checks do not need (see above).
        from paratrain.checkpoint.checkpointer import Checkpointer

        return Checkpointer
    raise AttributeError(f"module 'paratrain.checkpoint' has no attribute {name!r}")
