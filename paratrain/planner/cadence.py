"""The checkpoint interval ``paratrain plan`` shows for a cluster: Young/Daly's sqrt(2 x save cost x MTBF), the
save cost estimated from the checkpoint's size and a write bandwidth per node, the MTBF a node's over the nodes.

A run under ``checkpoint.every_steps: auto`` measures its real save cost instead (``checkpoint.interval``);
this is the estimate before renting the machines.
"""

from __future__ import annotations

from paratrain.checkpoint.interval import plan_interval
from paratrain.config.schema import OptimConfig
from paratrain.planner.accounting import FP32, optimizer_bytes
from paratrain.planner.model_facts import ModelFacts
from paratrain.planner.units import parse_memory


def checkpoint_bytes(facts: ModelFacts, optim: OptimConfig) -> int:
    """Bytes of a checkpoint: every parameter and the optimizer state of the trained ones, fp32, each saved once
    whatever the layout (DCP writes a replicated tensor from one rank)."""
    trainable = [param for param in facts.params if param.trainable]
    trained = sum(param.numel for param in trainable)
    return FP32 * facts.num_params + optimizer_bytes(trained, num_tensors=len(trainable), optim=optim)


def interval_lines(
    facts: ModelFacts, optim: OptimConfig, *, nodes: int, mtbf_hours: float | None, save_bandwidth: str
) -> list[str]:
    """The report's lines on the checkpoint interval.

    Args:
        mtbf_hours: One node's mean time between failures; None: the lines say how to give it.
        save_bandwidth: What one node writes per second, as the user wrote it ("2GB").
    """
    if mtbf_hours is None:
        return ["checkpoint interval: give --mtbf-hours (one node's mean time between failures) to see it"]
    size = checkpoint_bytes(facts, optim)
    per_node = size / nodes  # every node writes its ranks' shards at once
    cost = per_node / parse_memory(save_bandwidth, argument="--save-bandwidth")
    mtbf_s = mtbf_hours * 3600 / nodes
    plan = plan_interval(save_cost_s=cost, mtbf_s=mtbf_s)
    return [
        f"checkpoint interval (Young/Daly; checkpoint.every_steps=auto measures the real save cost): checkpoint "
        f"{size / 1e9:.3g} GB, {per_node / 1e9:.3g} GB per node at {save_bandwidth}/s (--save-bandwidth): a "
        f"synchronous save blocks about {cost:.3g} s; MTBF {mtbf_hours:g} h per node (--mtbf-hours), "
        f"{mtbf_s / 3600:.3g} h for {nodes} node(s)",
        f"  save {plan.describe()}",
    ]
