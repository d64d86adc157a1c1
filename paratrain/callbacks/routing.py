"""Router statistics of a mixture-of-experts model in the metrics record: the load-balancing loss apart
from the training loss, and the fewest and most tokens any expert of any layer computed in the logged
step, so a router collapsing onto a few experts shows as ``moe_expert_tokens_min`` falling towards 0."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from paratrain.callbacks.base import Callback, CallbackContext
from paratrain.models.contract import BalancesExperts, RoutesTokens, RoutingStats
from paratrain.parallel.collectives import all_reduce_min_max, all_reduce_sum
from paratrain.parallel.dims import ParallelDims


def maybe_router_stats(model: nn.Module) -> list[Callback]:
    """[RouterStats()] when the model (this rank's part of it) has layers that route tokens, else []."""
    return [RouterStats()] if routing_layers(model) else []


def routing_layers(model: nn.Module) -> list[RoutesTokens]:
    return [module for module in model.modules() if isinstance(module, RoutesTokens)]


class RouterStats(Callback):
    """Reads every routing layer after each step (which also starts the next step's counts afresh); on
    log steps adds ``moe_aux_loss`` (mean over layers, micro-batches and ranks of the unweighted loss),
    ``moe_expert_tokens_min``/``_max`` (over layers and experts, each count summed over the
    data-parallel and context-parallel ranks: the tokens the expert computed for the whole global batch)
    and, when an expert dropped any, ``moe_dropped_tokens`` (over layers). Every step it also hands the
    layers that balance with a bias their step's counts (``BalancesExperts``)."""

    def on_train_start(self, context: CallbackContext) -> None:
        """Forgets forwards run before training (a pipeline's shape and cost probes)."""
        for layer in routing_layers(context.trainer.bare_model):
            layer.pop_routing_stats()

    def on_step_end(self, context: CallbackContext) -> None:
        layers = routing_layers(context.trainer.bare_model)
        stats = [layer.pop_routing_stats() for layer in layers]
        groups, device = token_groups(context.trainer.dims), context.trainer.ctx.device
        balance_experts(layers, stats, groups=groups, device=device)
        if context.record is None:
            return
        summary = summarise(
            [s for s in stats if s is not None], groups=groups, tp=context.trainer.dims.tp, device=device
        )
        context.record.update(summary)


def token_groups(dims: ParallelDims) -> list[dist.ProcessGroup]:
    """The ranks whose tokens of the same layers add up to a step's: the data-parallel ranks (different
    samples) and the context-parallel ranks (different parts of the same sequences)."""
    if dims.mesh is None:
        return []
    groups = [dims.batch_mesh.get_group()] if dims.dp > 1 else []
    return groups + ([dims.cp_mesh.get_group()] if dims.cp_enabled else [])


def balance_experts(
    layers: list[RoutesTokens],
    stats: list[RoutingStats | None],
    *,
    groups: list[dist.ProcessGroup],
    device: torch.device,
) -> None:
    """Hands each layer that balances with a bias the tokens its experts computed in the step, summed over
    ``groups`` (every rank of the same layers calls this, so every one moves its bias the same way)."""
    balancing: list[tuple[BalancesExperts, RoutingStats]] = [
        (layer, s) for layer, s in zip(layers, stats, strict=True) if s is not None and s.balance_bias
    ]
    if not balancing:
        return
    counts = torch.stack([s.tokens_per_expert.to(device, torch.float64) for _, s in balancing])
    for group in groups:
        counts = all_reduce_sum(counts, group=group)
    for (layer, _), layer_counts in zip(balancing, counts, strict=True):
        layer.update_expert_bias(layer_counts)


def summarise(
    stats: list[RoutingStats], *, groups: list[dist.ProcessGroup], tp: int, device: torch.device
) -> dict[str, float]:
    """The record's fields from this rank's layers' statistics, reduced over every rank (all ranks call
    it: pipeline stages hold different layers, data-parallel ranks different tokens of the same layers).

    Args:
        stats: One entry per routing layer this rank holds that ran in the step.
        groups: The data-parallel and context-parallel ranks, whose counts for one layer add up (``token_groups``).
        tp: Tensor-parallel degree: its ranks route the same tokens, so world sums count each tp times.
        device: Where this rank's collectives run.
    """
    counts = torch.stack([s.tokens_per_expert.to(device, torch.float64) for s in stats]) if stats else None
    for group in groups if counts is not None else ():
        counts = all_reduce_sum(counts, group=group)
    no_layer = torch.tensor([float("inf"), float("-inf")], device=device, dtype=torch.float64)
    local = torch.stack([counts.min(), counts.max()]) if counts is not None else no_layer
    minimum, maximum = all_reduce_min_max(local)
    totals = torch.tensor(
        [[float(s.aux_loss), s.forwards, float(s.dropped)] for s in stats] or [[0.0, 0.0, 0.0]],
        device=device,
        dtype=torch.float64,
    ).sum(dim=0)
    aux_sum, forwards, dropped = all_reduce_sum(totals).tolist()
    record = {"moe_aux_loss": aux_sum / forwards} if forwards else {}  # none: a model without one (DeepSeek-V3)
    record |= {"moe_expert_tokens_min": minimum[0].item(), "moe_expert_tokens_max": maximum[1].item()}
    if dropped:
        record["moe_dropped_tokens"] = dropped / tp
    return record
