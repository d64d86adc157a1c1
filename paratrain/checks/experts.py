"""Expert-parallel settings checked before any process starts: each refusal names the keys and the fix."""

from __future__ import annotations

from torch import nn

from paratrain.models.plan_derivation import plan_of
from paratrain.parallel.dims import ParallelDims


def check_expert_layout(dims: ParallelDims, *, model: nn.Module) -> None:
    """Raises ConfigError when parallel.ep cannot divide ``model``'s experts (``model`` built on meta): a model
    without experts, one that cannot take the dispatch (a transformers family the dispatch was not checked
    against, named), ep not dividing them."""
    if not dims.ep_enabled:
        return
    # lazy: loaded only for the runs that use it (DTensor) to keep the launcher's checks fast
    from paratrain.parallel.expert import check_expert_plan

    check_expert_plan(model, plan_of(model), ep=dims.ep)
