"""Router statistics of a transformers mixture-of-experts model, as paratrain's GPT reports its own
(``RoutesTokens``, models/contract.py): the tokens each expert of each layer was sent, and the family's own
load-balancing loss, so that ``moe_aux_loss`` and ``moe_expert_tokens_min``/``_max`` reach the metrics.

transformers 5's blocks hand their experts module ``(hidden, top_k_index, top_k_weights)``: the router's
choice, whichever router the family has (softmax top-k, DeepSeek-V3's grouped sigmoid routing). A pre-hook
on each experts module counts ``top_k_index``; a hook on the model reads the unweighted ``aux_loss`` its
forward returns (when the family defines one; DeepSeek-V3's balancing is its router's bias instead). The
counts live in a parameter-free submodule of the model, so the model's state dict is unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.models.contract import RoutingStats

RECORDER_NAME = "paratrain_routing"


def stacked_experts(model: nn.Module) -> list[nn.Module]:
    """The model's experts modules that stack their weights (transformers 5's), in forward order."""
    return [
        module
        for module in model.modules()
        if isinstance(getattr(module, "num_experts", None), int)
        and isinstance(getattr(module, "down_proj", None), nn.Parameter)
        and module.down_proj.ndim == 3
    ]


def maybe_record_routing(model: nn.Module) -> nn.Module:
    """``model`` with a ``RoutingRecorder`` counting its routers' choices when it stacks experts (unchanged
    otherwise: a dense model, or a transformers 4.x family whose routing happens inside one module)."""
    experts = stacked_experts(model)
    if not experts:
        return model
    recorder = RoutingRecorder(num_layers=len(experts), num_experts=experts[0].num_experts)
    model.add_module(RECORDER_NAME, recorder)
    for layer, module in enumerate(experts):
        module.register_forward_pre_hook(_counting_hook(recorder, layer), with_kwargs=True)
    model.register_forward_hook(_aux_loss_hook(recorder))
    return model


class RoutingRecorder(nn.Module):
    """What a transformers MoE model routed in the training forwards since the last ``pop_routing_stats``:
    ``(layers, experts)`` assignments, and the sum of the forwards' unweighted aux losses."""

    def __init__(self, *, num_layers: int, num_experts: int):
        super().__init__()
        self.num_layers, self.num_experts = num_layers, num_experts
        self._counts: torch.Tensor | None = None
        self._aux_loss: torch.Tensor | None = None
        self._forwards = 0

    def count(self, layer: int, top_k_index: torch.Tensor) -> None:
        counts = torch.bincount(top_k_index.reshape(-1), minlength=self.num_experts)[: self.num_experts]
        if self._counts is None:
            self._counts = torch.zeros(self.num_layers, self.num_experts, dtype=counts.dtype, device=counts.device)
        self._counts[layer] += counts

    def add_aux_loss(self, aux_loss: torch.Tensor) -> None:
        self._aux_loss = aux_loss if self._aux_loss is None else self._aux_loss + aux_loss
        self._forwards += 1

    def pop_routing_stats(self) -> RoutingStats | None:
        """The counts since the last call (None if no training forward ran); starts anew."""
        if self._counts is None:
            return None
        zero = torch.zeros((), device=self._counts.device)
        aux = self._aux_loss if self._aux_loss is not None else zero
        stats = RoutingStats(self._counts, zero, aux, forwards=self._forwards)
        self._counts, self._aux_loss, self._forwards = None, None, 0
        return stats


def _recording(module: nn.Module) -> bool:
    return module.training and torch.is_grad_enabled()  # not evaluation, not a pipeline's no-grad shape probe


def _counting_hook(recorder: RoutingRecorder, layer: int):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        if _recording(module):
            recorder.count(layer, top_k_index.detach())

    return hook


def _aux_loss_hook(recorder: RoutingRecorder):
    def hook(model: nn.Module, inputs, outputs) -> None:
        aux_loss = getattr(outputs, "aux_loss", None)
        if isinstance(aux_loss, torch.Tensor) and _recording(model):
            recorder.add_aux_loss(aux_loss.detach().float())

    return hook
