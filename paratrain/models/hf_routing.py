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

from paratrain.errors import ConfigError
from paratrain.models.contract import RoutingStats
from paratrain.models.moe import nudge_towards_balance

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


def maybe_record_routing(model: nn.Module, *, balance: str | None = None, rate: float = 1e-3) -> nn.Module:
    """``model`` with a ``RoutingRecorder`` counting its routers' choices when it stacks experts (unchanged
    otherwise: a dense model, or a transformers 4.x family whose routing happens inside one module).

    Args:
        balance: ``bias``: the recorder also moves each router's per-expert bias after every step
            (aux-loss-free balancing); None: the family's own balancing.
        rate: How far each bias moves per step.

    Raises:
        ConfigError: naming model.args.moe_balance when the model's routers hold no per-expert bias.
    """
    experts = stacked_experts(model)
    routers = _biased_routers(model, experts) if balance == "bias" else None
    if balance not in (None, "bias") or (balance == "bias" and not routers):
        raise ConfigError(
            f"model.args.moe_balance={balance!r}: transformers' {type(model).__name__} has no router with a "
            "per-expert bias to balance with (DeepSeek-V3's e_score_correction_bias); leave moe_balance out to "
            "use the family's own load-balancing loss"
        )
    if not experts:
        return model
    recorder = RoutingRecorder(num_layers=len(experts), num_experts=experts[0].num_experts, routers=routers, rate=rate)
    model.add_module(RECORDER_NAME, recorder)
    for layer, module in enumerate(experts):
        module.register_forward_pre_hook(_counting_hook(recorder, layer), with_kwargs=True)
    model.register_forward_hook(_aux_loss_hook(recorder))
    return model


class RoutingRecorder(nn.Module):
    """What a transformers MoE model routed in the training forwards since the last ``pop_routing_stats``:
    ``(layers, experts)`` assignments, and the sum of the forwards' unweighted aux losses."""

    def __init__(
        self, *, num_layers: int, num_experts: int, routers: list[nn.Module] | None = None, rate: float = 1e-3
    ):
        super().__init__()
        self.num_layers, self.num_experts = num_layers, num_experts
        # A plain list, not submodules: the routers stay where the model has them. Their bias is looked up at
        # each update, as materialising the model replaces its buffers.
        self._routers, self._rate = routers, rate
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
        stats = RoutingStats(self._counts, zero, aux, forwards=self._forwards, balance_bias=self._routers is not None)
        self._counts, self._aux_loss, self._forwards = None, None, 0
        return stats

    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """Aux-loss-free balancing: each layer's router bias moves towards an even load (``BalancesExperts``)."""
        for router, layer_counts in zip(self._routers, tokens_per_expert, strict=True):
            nudge_towards_balance(router.e_score_correction_bias, layer_counts, rate=self._rate)


def _biased_routers(model: nn.Module, experts: list[nn.Module]) -> list[nn.Module]:
    """Each experts module's sibling router (``gate``), in the same order, when every one holds a per-expert
    bias buffer (DeepSeek-V3's ``e_score_correction_bias``); [] otherwise."""
    paths = {id(module): path for path, module in model.named_modules()}
    routers = [getattr(model.get_submodule(paths[id(m)].rpartition(".")[0]), "gate", None) for m in experts]
    biased = all(isinstance(getattr(router, "e_score_correction_bias", None), torch.Tensor) for router in routers)
    return routers if routers and biased else []


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
