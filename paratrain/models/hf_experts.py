"""Expert parallel for transformers' mixture-of-experts families: their experts found as data, and their
experts' forward given paratrain's token dispatch.

transformers 5 keeps a family's experts as one module holding the stacked weights (``gate_up_proj``
``(experts, 2 * intermediate, hidden)`` and ``down_proj`` ``(experts, hidden, intermediate)``) and lets the
forward be chosen by name through its ``ExpertsInterface`` (``config._experts_implementation``), as the
attention is through ``AttentionInterface``. The model's own router picks each token's top k; its block
hands ``experts(hidden, top_k_index, top_k_weights)`` the result. Under expert parallel paratrain
registers one more implementation under that interface, which sorts the token copies by expert, hands them
to the layout's dispatch (all-to-all to the ranks holding them, parallel/expert.py), runs this rank's
experts with the module's own weights (its slice of each stacked tensor) and combines the results as
transformers' own implementations do. Parameter names and full shapes stay the family's, so a checkpoint
loads, and exports, in transformers' layout.

The families are those checked against one process (tests/parity/test_hf_experts_match_single.py); any
other experts module is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.tensors import local_part

IMPLEMENTATION_NAME = "paratrain_expert_parallel"

# Experts modules whose forward this dispatch replaces exactly: gated (gate_up_proj packed [gate; up]), no
# biases, weights (out, in) per expert, nothing after the down projection.
DISPATCHED = ("Qwen3MoeExperts", "MixtralExperts", "Qwen2MoeExperts", "DeepseekV3Experts")
# The config keys that set the experts per block, by family (each config declares one, and may alias another).
_EXPERT_COUNT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")

Dispatch = Callable[[Callable[[torch.Tensor, int], torch.Tensor], torch.Tensor, torch.Tensor], torch.Tensor]


def transformers_experts(model: nn.Module, blocks: tuple[str, ...]) -> dict:
    """ParallelPlan fields for a transformers model's experts: the path of its experts module inside a
    block and the config key counting them, or why expert parallel cannot divide them. {} without experts."""
    found = _experts_in_blocks(model, blocks)
    if not found:
        return {}
    path, module = found
    refusal = _refusal(model, module)
    if refusal:
        return {"expert_refusal": refusal}
    return {"block_experts": (path,), "num_experts": _expert_count(model, module)}


def _experts_in_blocks(model: nn.Module, blocks: tuple[str, ...]) -> tuple[str, nn.Module] | None:
    """(path inside the block, module) of the first module holding experts in any block (DeepSeek-V3's first
    blocks are dense), or None."""
    for block in blocks:
        for path, module in model.get_submodule(block).named_modules():
            if _holds_experts(module):
                return path, module
    return None


def _holds_experts(module: nn.Module) -> bool:
    """Stacked expert weights (transformers 5), or a ModuleList of expert MLPs (4.x's sparse MoE blocks)."""
    stacked = getattr(module, "down_proj", None)
    return (isinstance(stacked, nn.Parameter) and stacked.ndim == 3) or isinstance(
        getattr(module, "experts", None), nn.ModuleList
    )


def _refusal(model: nn.Module, module: nn.Module) -> str:
    name, kind = type(model).__name__, type(module).__name__
    if not isinstance(getattr(module, "down_proj", None), nn.Parameter):
        return (
            f"transformers' {name} keeps its experts as separate modules ({kind} of one MLP each, as transformers "
            "4.x does), which paratrain does not divide over ranks; expert parallel needs transformers 5, whose "
            "families stack each expert weight in one tensor"
        )
    if kind not in DISPATCHED:
        families = ", ".join(DISPATCHED)
        return (
            f"transformers' {name} computes its experts in {kind}, which is not among the experts modules "
            f"paratrain's dispatch was checked against ({families})"
        )
    if not hasattr(module, "has_gate"):  # set by transformers' use_experts_implementation, which picks the forward
        return (
            f"transformers' {name} does not choose its experts' forward through transformers' ExpertsInterface "
            f"(an older transformers 5 release), where paratrain installs its dispatch; upgrade transformers"
        )
    return ""


def _expert_count(model: nn.Module, module: nn.Module) -> dict[str, int]:
    config = model.config
    declared = [key for key in _EXPERT_COUNT_KEYS if key in getattr(type(config), "__annotations__", {})]
    present = [key for key in _EXPERT_COUNT_KEYS if getattr(config, key, None) == module.num_experts]
    key = (declared or present or [None])[0]
    return {f"model.args.{key or 'num_experts'}": module.num_experts}


def install_transformers_dispatch(model: nn.Module, experts: list[nn.Module], dispatch: Dispatch) -> None:
    """Makes each experts module in ``experts`` compute through ``dispatch`` (every one of ``model``'s)."""
    # Lazy: transformers is an optional dependency; only models it built get here.
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION_NAME, dispatched_experts_forward)
    for module in experts:
        module.paratrain_dispatch = dispatch
        module.config._experts_implementation = IMPLEMENTATION_NAME
    model.config._experts_implementation = IMPLEMENTATION_NAME


def dispatched_experts_forward(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts signature: ``hidden_states`` (tokens, hidden), the router's ``top_k_index`` and
    ``top_k_weights`` (tokens, k) in; each token's weighted sum of its experts' outputs out.

    The token copies go to ``module.paratrain_dispatch`` grouped by expert (stable: token order within each);
    the outputs come back in that order, are weighted, put back in (token, k) order and summed over k in
    float32 before the cast, as transformers' grouped_mm implementation sums them.
    """
    top_k = top_k_index.shape[-1]
    assignments = top_k_index.reshape(-1)
    order = torch.sort(assignments, stable=True).indices
    counts = torch.bincount(assignments, minlength=module.num_experts)
    computed = module.paratrain_dispatch(LocalExperts(module), hidden_states[order // top_k], counts)
    weighted = computed * top_k_weights.reshape(-1)[order, None]
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    combined = weighted[back].view(-1, top_k, hidden_states.shape[-1]).sum(dim=1)
    return combined.to(hidden_states.dtype)


class LocalExperts:
    """One rank's experts of a transformers experts module: ``(x, index)`` -> expert ``index`` (counted among
    the experts this rank holds: its slice of each stacked weight) applied to the rows ``x``."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, x: torch.Tensor, index: int) -> torch.Tensor:
        module = self.module
        gate_up = F.linear(x, local_part(module.gate_up_proj)[index])
        return F.linear(module._apply_gate(gate_up), local_part(module.down_proj)[index])
