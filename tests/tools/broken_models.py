"""A layout bug on purpose, for verify to catch: a gradient scaled wrongly only when training distributed."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from paratrain.models.gpt import build_gpt


def build_gpt_with_wrong_gradient(
    *, block_size: int, n_layer: int, n_head: int, n_embd: int, grad_scale: float = 1.5
) -> nn.Module:
    """The tiny GPT, whose last block's MLP output weight gets grad_scale x its gradient under a world size > 1.

    One process trains correctly; any multi-process layout does not, as a layout bug would behave.
    """
    model = build_gpt(block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)

    def scale_when_distributed(gradient: torch.Tensor) -> torch.Tensor:
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        return gradient * grad_scale if distributed else gradient

    def hook_the_weight(module: nn.Module, args) -> None:
        # Hooked at forward time: the weight the factory made is replaced when the layout
        # materialises the model built on the meta device.
        if not getattr(module.weight, "scaled_when_distributed", False):
            module.weight.register_hook(scale_when_distributed)
            module.weight.scaled_when_distributed = True

    model.get_submodule(f"blocks.{n_layer - 1}.mlp.down_proj").register_forward_pre_hook(hook_the_weight)
    return model
