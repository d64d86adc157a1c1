"""A mixture-of-experts feed-forward for paratrain's GPT: a router choosing ``top_k`` experts per token
(softmax over all experts, then the top k, renormalised to sum to one, as Mixtral and Qwen3-MoE do), the
experts' weights stacked along a leading expert dimension, the Switch Transformer load-balancing loss,
and an optional capacity per expert with the tokens over it counted as dropped.

Why stacked weights, shape ``(num_experts, ...)``, rather than a ModuleList of small feed-forwards: the
expert is then dim 0 of every expert tensor, so FSDP2's default ``Shard(0)`` and a later expert-parallel
``Shard(0)`` on an ``ep`` mesh both hand each rank whole experts with one DTensor per weight (as
torchtitan's ``GroupedExperts`` does), and a grouped matmul can replace the per-expert loop without a
change of checkpoint format. A ModuleList would need one sharding decision per expert module and
parameter names that change with the number of experts held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models.contract import RoutingStats
from paratrain.tensors import local_part

# aux_loss: the Switch Transformer loss in the training loss. bias: none (aux-loss-free, DeepSeek-V3): a per-expert
# bias added to the router's scores for the choice alone, nudged after every step towards an even load.
MoEBalance = Literal["aux_loss", "bias"]


@dataclass(frozen=True)
class MoEConfig:
    """The MoE feed-forward's shape (``build_gpt``'s ``moe_*`` arguments).

    Attributes:
        num_experts: Experts per block.
        top_k: Experts each token is sent to.
        aux_loss_coef: Weight of the load-balancing loss in the training loss.
        capacity_factor: Each expert computes at most ``ceil(capacity_factor * tokens * top_k /
            num_experts)`` of a forward's tokens, in token order; the rest of its assignments are
            dropped (the residual connection carries those tokens). None: no limit.
        balance: How the load is balanced (``MoEBalance``); under ``bias`` the aux loss is only logged.
        bias_update_rate: How far each expert's bias moves per step under ``bias`` (DeepSeek-V3's gamma).
    """

    num_experts: int
    top_k: int = 2
    aux_loss_coef: float = 0.01
    capacity_factor: float | None = None
    balance: MoEBalance = "aux_loss"
    bias_update_rate: float = 1e-3


@dataclass(frozen=True)
class Routing:
    """One forward's routing decision for ``tokens`` flattened tokens."""

    probs: torch.Tensor  # (tokens, num_experts): softmax of the router's logits, float32
    weights: torch.Tensor  # (tokens, top_k): the chosen experts' probabilities, renormalised
    experts: torch.Tensor  # (tokens, top_k): the chosen experts' indices


class Router(nn.Module):
    """A bias-free linear layer scoring each expert for each token; picks the top k.

    With ``balance_bias`` it also holds ``expert_bias`` (a buffer, so checkpoints keep it), added to the
    probabilities to choose the experts but not to weight them, as DeepSeek-V3's router does."""

    def __init__(self, dim: int, *, num_experts: int, top_k: int, balance_bias: bool = False):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.top_k = top_k
        self.expert_bias = nn.Buffer(torch.zeros(num_experts)) if balance_bias else None

    def forward(self, x: torch.Tensor) -> Routing:
        probs = F.softmax(self.gate(x).float(), dim=-1)  # float32 like transformers: the aux loss sums these
        scores = probs if self.expert_bias is None else probs + self.expert_bias
        experts = scores.topk(self.top_k, dim=-1).indices
        weights = probs.gather(-1, experts)
        return Routing(probs, weights / weights.sum(dim=-1, keepdim=True), experts)


class Experts(nn.Module):
    """``num_experts`` GELU feed-forwards (``dim -> hidden -> dim``) as two stacked weights.

    Under expert parallel each weight is a DTensor sharded on dim 0 over the ep ranks; ``forward`` uses
    the rank's own slice, so ``expert`` counts among the experts this rank holds.
    """

    def __init__(self, dim: int, hidden: int, *, num_experts: int):
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """Expert ``expert`` (of those held here) applied to the tokens ``x`` (tokens, dim) sent to it."""
        return F.gelu(x @ local_part(self.up_proj)[expert]) @ local_part(self.down_proj)[expert]


def compute_experts_locally(experts: Experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Every expert on this rank: ``x`` (assignments sorted by expert) split by ``counts``, each piece
    through its expert, in the same order (the default dispatch; expert parallel installs an all-to-all)."""
    pieces = x.split(counts.tolist())
    return torch.cat([experts(piece, index) for index, piece in enumerate(pieces)])


class MoEFeedForward(nn.Module):
    """Routes each token to its top-k experts and sums their outputs, weighted by the router.

    The token copies go to the experts through ``dispatch`` (``compute_experts_locally`` unless a layout
    installs another: expert parallel's all-to-all), grouped by expert.

    After a forward, ``aux_loss`` holds that forward's load-balancing loss (unweighted); in training mode
    the tokens each expert computed, the dropped assignments and the aux loss also accumulate until
    ``pop_routing_stats`` (the ``RoutesTokens`` hook) reads them, so a collapsing router is visible in the
    metrics.
    """

    def __init__(self, dim: int, hidden: int, moe: MoEConfig, *, dropout: float = 0.0):
        super().__init__()
        self.moe = moe
        self.router = Router(dim, num_experts=moe.num_experts, top_k=moe.top_k, balance_bias=moe.balance == "bias")
        self.experts = Experts(dim, hidden, num_experts=moe.num_experts)
        self.dropout = nn.Dropout(dropout)
        self.dispatch = compute_experts_locally
        self.aux_loss: torch.Tensor | None = None
        self._stats: RoutingStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        routing = self.router(tokens)
        kept = keep_within_capacity(routing.experts, num_experts=self.moe.num_experts, capacity=self._capacity(tokens))
        # Kept assignments grouped by expert (stable: token order within each), as the dispatch takes them.
        token_index, slot = torch.where(kept)
        order = torch.sort(routing.experts[token_index, slot], stable=True).indices
        token_index, slot = token_index[order], slot[order]
        counts = torch.bincount(routing.experts[token_index, slot], minlength=self.moe.num_experts)
        computed = self.dispatch(self.experts, tokens[token_index], counts)
        weighted = computed * routing.weights[token_index, slot, None]
        out = torch.zeros_like(tokens).index_add_(0, token_index, weighted.to(tokens.dtype))
        self.aux_loss = load_balancing_loss(routing.probs, routing.experts, num_experts=self.moe.num_experts)
        if self.training and torch.is_grad_enabled():  # not a pipeline stage's no-grad shape probe
            self._record(routing.experts, kept)
        return self.dropout(out.view_as(x))

    def pop_routing_stats(self) -> RoutingStats | None:
        """What the training forwards since the last call routed (None if there were none); starts anew."""
        stats, self._stats = self._stats, None
        return stats

    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """Aux-loss-free balancing, after a step whose tokens each expert computed (summed over every rank) are
        ``tokens_per_expert``: each expert's router bias moves by ``bias_update_rate`` towards an even load."""
        nudge_towards_balance(self.router.expert_bias, tokens_per_expert, rate=self.moe.bias_update_rate)

    def _capacity(self, tokens: torch.Tensor) -> int | None:
        factor = self.moe.capacity_factor
        return None if factor is None else math.ceil(factor * tokens.shape[0] * self.moe.top_k / self.moe.num_experts)

    def _record(self, experts: torch.Tensor, kept: torch.Tensor) -> None:
        received = torch.bincount(experts[kept], minlength=self.moe.num_experts)
        balance_bias = self.moe.balance == "bias"
        step = RoutingStats(received, (~kept).sum(), self.aux_loss.detach(), forwards=1, balance_bias=balance_bias)
        self._stats = step if self._stats is None else self._stats.plus(step)


def keep_within_capacity(experts: torch.Tensor, *, num_experts: int, capacity: int | None) -> torch.Tensor:
    """Which (token, slot) assignments their expert computes: all of them without a capacity; with one,
    each expert's first ``capacity`` assignments in token order (Switch Transformer's rule), the rest dropped.

    Args:
        experts: (tokens, top_k) chosen expert indices.
        num_experts: Experts in the layer.
        capacity: Assignments an expert computes at most, or None.
    """
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    one_hot = F.one_hot(experts.reshape(-1), num_experts)  # (tokens * top_k, experts), token-major
    position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1)  # 1-based place in its expert's queue
    return (position <= capacity).view_as(experts)


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, *, num_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, ``num_experts * sum_e f_e * P_e``, with ``f_e`` the (token, slot)
    assignments routed to expert e per token (before any capacity drop) and ``P_e`` the mean router
    probability of e: transformers' ``load_balancing_loss_func`` for one layer. Equal to ``top_k`` when the
    routing is uniform, larger when it is not.

    Args:
        probs: (tokens, num_experts) router probabilities.
        experts: (tokens, top_k) chosen expert indices.
        num_experts: Experts in the layer.
    """
    counts = torch.zeros(num_experts, device=probs.device).index_add_(
        0, experts.reshape(-1), torch.ones(experts.numel(), device=probs.device)
    )
    return num_experts * torch.sum(counts / probs.shape[0] * probs.mean(dim=0))


def nudge_towards_balance(bias: torch.Tensor, tokens_per_expert: torch.Tensor, *, rate: float) -> None:
    """DeepSeek-V3's update (arXiv 2412.19437, 2.1.2), in place: ``bias_e += rate * sign(mean load - load_e)``,
    so an expert that got fewer tokens than the mean is chosen more readily the next step, and the reverse.

    Args:
        bias: (..., num_experts) per-expert biases (one row per layer, or one layer's).
        tokens_per_expert: The same shape: the tokens each expert computed in the step, over every rank.
        rate: How far each bias moves per step.
    """
    load = tokens_per_expert.to(bias.device, torch.float32)
    bias.add_(rate * torch.sign(load.mean(dim=-1, keepdim=True) - load))
