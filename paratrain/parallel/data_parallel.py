"""torch.nn.DataParallel: one process drives every local GPU (the usual first multi-GPU step)."""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def apply_data_parallel(model: nn.Module, *, device: torch.device) -> nn.Module:
    """Replicates the model over all local GPUs each forward. With fewer than two GPUs there is
    nothing to replicate over: the model runs as is on its one device, and the log says so."""
    num_gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if num_gpus < 2:
        logger.warning("parallel.strategy=dp: %d GPU(s) visible, running on %s without DataParallel", num_gpus, device)
        return model
    logger.info("parallel.strategy=dp: DataParallel over %d GPUs", num_gpus)
    return nn.DataParallel(model)
