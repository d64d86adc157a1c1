"""Mixed precision: autocast for the forward pass, and a gradient scaler for fp16.

Weights, gradients and optimizer state stay fp32 in every mode; only the compute is lowered.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

Precision = Literal["fp32", "bf16", "fp16"]

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class MixedPrecision:
    """The autocast context for forward passes and, for fp16, the loss scaler."""

    precision: Precision
    device_type: str
    scaler: torch.amp.GradScaler | None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=_AUTOCAST_DTYPES[self.precision])

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Brings gradients back to their true size before they are clipped or logged."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Steps the optimizer; under fp16 the scaler skips steps whose gradients overflowed."""
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()


class ScalarFlagShardedGradScaler(ShardedGradScaler):
    """torch's ShardedGradScaler with the overflow flag a fused optimizer can take.

    ShardedGradScaler records an overflow in a tensor of shape [1] (GradScaler: a scalar). A fused AdamW
    or SGD subtracts that flag from each parameter's step count, a scalar, in place, which a [1] cannot
    broadcast into (torch 2.13: "output with shape [] doesn't match the broadcast shape [1]"), so fsdp
    under fp16 failed at its first step with the fused kernels. The flag is kept a scalar from the start.
    """

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        return super()._unscale_grads_(optimizer, inv_scale, found_inf.reshape(()), allow_fp16)


def build_mixed_precision(precision: Precision, *, device: torch.device, sharded: bool) -> MixedPrecision:
    """Autocast settings and, for fp16, the loss scaler.

    With sharded gradients each rank sees only its shard, so one rank may find an overflow that
    others do not; ShardedGradScaler all-reduces that finding so every rank skips the same steps.
    """
    if precision != "fp16":
        return MixedPrecision(precision, device.type, None)
    scaler = ScalarFlagShardedGradScaler(device.type) if sharded else torch.amp.GradScaler(device.type)
    return MixedPrecision(precision, device.type, scaler)
