"""Bytes each rank sends per optimizer step under a layout, split into traffic within a node and
across nodes, and the time that takes at nominal link speeds. Used only to rank layouts.

Ring collectives over n ranks (what NCCL's bus bandwidth assumes): an all-reduce of S bytes sends
2(n-1)/n x S per rank, an all-gather or reduce-scatter (n-1)/n x S. A group stays within a node when
its ranks' span on the mesh ``arange(world).view(pp, dp_replicate, dp_shard, cp, tp)`` fits in one node
(tensor parallel is innermost); otherwise its ring crosses nodes and runs at the slower speed. Each
collective or send also costs a fixed latency, so many small messages (a pipeline's per-micro-batch
sends, tensor parallel's per-layer all-reduces) are not free for small models.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.parallel.dims import ParallelDims, micro_batch_size
from paratrain.parallel.float8 import gathers_in_float8
from paratrain.planner.accounting import DTYPE_BYTES, FP32, StageShare, activation_shape, gathered_bytes
from paratrain.planner.inputs import PlanInputs
from paratrain.planner.model_facts import ModelFacts

# Nominal per-GPU bandwidths (bytes/s): NVLink-class within a node, one 200 Gb/s NIC per GPU across nodes.
INTRA_NODE_BYTES_PER_S = 150e9
INTER_NODE_BYTES_PER_S = 25e9
LATENCY_S = 20e-6  # per collective or send: launch and synchronisation, whatever its size
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb: one all-reduce per bucket

TP_ALL_REDUCES_PER_LAYER = 4  # attention and MLP outputs in forward, their inputs' gradients in backward
# Context parallel's all_to_all: q, k, v and the attention output in forward, their gradients in backward.
CP_ALL_TO_ALLS_PER_LAYER = 8
ALL_TO_ALLS_PER_MOE_LAYER = 4  # expert parallel: dispatch and combine in forward, their gradients in backward


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends per step."""

    intra_node: float = 0.0
    inter_node: float = 0.0
    messages: int = 0  # collectives and sends issued

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(
            self.intra_node + other.intra_node, self.inter_node + other.inter_node, self.messages + other.messages
        )

    @property
    def total(self) -> float:
        return self.intra_node + self.inter_node

    @property
    def seconds(self) -> float:
        return (
            self.intra_node / INTRA_NODE_BYTES_PER_S
            + self.inter_node / INTER_NODE_BYTES_PER_S
            + self.messages * LATENCY_S
        )


def group_spans_nodes(dims: ParallelDims, axis: str, *, gpus_per_node: int) -> bool:
    """Whether the ranks of one group along ``axis`` lie on more than one node."""
    inner = dims.tp * dims.cp  # the mesh's order: pp, dp_replicate, dp_shard, cp, tp
    strides = {"tp": 1, "cp": dims.tp, "dp_shard_cp": dims.tp, "dp_shard": inner, "dp_replicate": inner * dims.dp_shard}
    stride = {**strides, "pp": inner * dims.dp}[axis]
    return stride * _axis_size(dims, axis) > gpus_per_node


def _axis_size(dims: ParallelDims, axis: str) -> int:
    """Ranks along a mesh axis; ``dp_shard_cp`` is FSDP's (dp_shard x cp, adjacent on the mesh)."""
    return dims.dp_shard * dims.cp if axis == "dp_shard_cp" else getattr(dims, axis)


def _sent(num_bytes: float, dims: ParallelDims, axis: str, *, gpus_per_node: int, messages: int) -> Traffic:
    if _axis_size(dims, axis) == 1 or num_bytes == 0:
        return Traffic()
    if group_spans_nodes(dims, axis, gpus_per_node=gpus_per_node):
        return Traffic(inter_node=num_bytes, messages=messages)
    return Traffic(intra_node=num_bytes, messages=messages)


def ring_factor(n: int, *, all_reduce: bool) -> float:
    return (2.0 if all_reduce else 1.0) * (n - 1) / n


def step_traffic(
    facts: ModelFacts, share: StageShare, inputs: PlanInputs, dims: ParallelDims, *, gpus_per_node: int
) -> Traffic:
    """What one rank of this pipeline share sends in one optimizer step."""
    micro_batches = inputs.train.global_batch_size // (
        micro_batch_size(inputs.train, inputs.pipeline, dims=dims) * dims.dp
    )
    # Before FSDP cuts it; of an expert tensor under ep, the rank's ep share, which FSDP gathers over the efsdp
    # ranks. Approximate: counted at dp_shard's ring factor ((n-1)/n of a smaller group is slightly less), and
    # hsdp's replica all-reduce of it as of a dp_shard shard (an efsdp one is ep times larger).
    numel = sum(param.local_numel(tp=dims.tp, ep=dims.ep) for param in share.params)
    float8 = gathers_in_float8(inputs.parallel.float8, fsdp=dims.fsdp_enabled, tp=dims.tp)
    gathered = gathered_bytes(share.params, dims, inputs.parallel.fsdp, float8=float8)
    units = fsdp_units(facts, share)
    traffic = _data_parallel_traffic(
        numel, inputs, dims, gathered=gathered, micro_batches=micro_batches, units=units, gpus_per_node=gpus_per_node
    )
    return (
        traffic
        + _activation_traffic(facts, share, inputs, dims, micro_batches=micro_batches, gpus_per_node=gpus_per_node)
        + expert_traffic(facts, share, inputs, dims, micro_batches=micro_batches, gpus_per_node=gpus_per_node)
    )


def expert_traffic(
    facts: ModelFacts,
    share: StageShare,
    inputs: PlanInputs,
    dims: ParallelDims,
    *,
    micro_batches: int,
    gpus_per_node: int,
) -> Traffic:
    """Expert parallel's all-to-alls: in each MoE layer and micro-batch, every token copy (top k of them per
    token) goes to its expert's rank and back in forward, and their gradients likewise in backward; the
    share staying on this rank ((1/ep) of them, with even routing) is not sent."""
    sizes = facts.transformer
    if not dims.ep_enabled or sizes is None or not sizes.moe_layers:
        return Traffic()
    shape = activation_shape(inputs, dims)
    copies = sizes.seq_len / dims.cp * shape.micro_batch * sizes.experts_per_token
    layers = min(share.layers, sizes.moe_layers)
    messages = ALL_TO_ALLS_PER_MOE_LAYER * layers * micro_batches
    sent = messages * copies * sizes.hidden * shape.element_bytes * (dims.ep - 1) / dims.ep
    return _sent(sent, dims, "dp_shard_cp", gpus_per_node=gpus_per_node, messages=messages)


def fsdp_units(facts: ModelFacts, share: StageShare) -> int:
    """FSDP's units on this share: its blocks, its outer groups (embedding; norm and head), and the root."""
    blocks = sum(1 for block in facts.plan.blocks if share.holds(block))
    outer = sum(1 for group in facts.plan.outer_units if all(share.holds(path) for path in group))
    return blocks + outer + 1


def _data_parallel_traffic(
    numel: int,
    inputs: PlanInputs,
    dims: ParallelDims,
    *,
    gathered: int,
    micro_batches: int,
    units: int,
    gpus_per_node: int,
) -> Traffic:
    """DDP all-reduces fp32 gradients once per step. FSDP all-gathers parameters (``gathered`` bytes, whose
    float8 weights count 1 byte each: accounting.gathered_bytes) for every micro-batch's forward (and again
    for backward when it reshards after forward) and reduce-scatters gradients (every micro-batch, or once);
    HSDP then all-reduces its shard across replicas."""
    if dims.ddp_enabled:
        buckets = -(-FP32 * numel // DDP_BUCKET_BYTES)
        return _sent(
            ring_factor(dims.dp_replicate, all_reduce=True) * FP32 * numel,
            dims,
            "dp_replicate",
            gpus_per_node=gpus_per_node,
            messages=buckets,
        )
    if not dims.fsdp_enabled:
        return Traffic()
    fsdp = inputs.parallel.fsdp
    reduced = DTYPE_BYTES[fsdp.resolved_reduce_dtype() or "fp32"]
    accumulation = micro_batches if dims.pp == 1 else 1  # a pipeline's stages gather once per step
    gathers = accumulation * (2 if fsdp.reshard_after_forward else 1)
    reductions = accumulation if fsdp.grad_sync == "every_micro_batch" else 1
    ring = ring_factor(dims.fsdp_size, all_reduce=False)
    traffic = _sent(
        ring * (gathers * gathered + reductions * reduced * numel),
        dims,
        "dp_shard_cp",
        gpus_per_node=gpus_per_node,
        messages=(gathers + reductions) * units,
    )
    replicas = ring_factor(dims.dp_replicate, all_reduce=True) * reduced * numel / dims.fsdp_size
    return traffic + _sent(
        reductions * replicas, dims, "dp_replicate", gpus_per_node=gpus_per_node, messages=reductions * units
    )


def _activation_traffic(
    facts: ModelFacts,
    share: StageShare,
    inputs: PlanInputs,
    dims: ParallelDims,
    *,
    micro_batches: int,
    gpus_per_node: int,
) -> Traffic:
    """Tensor parallel all-reduces each layer's activations; context parallel trades each layer's q, k, v and
    attention output with its cp ranks (all-to-all: each rank sends (cp - 1) / cp of its share); a pipeline
    sends each micro-batch's activations forward and their gradients back. Needs the transformer sizes
    (other models: no tp plan, pp not counted)."""
    sizes = facts.transformer
    if sizes is None:
        return Traffic()
    shape = activation_shape(inputs, dims)
    activation = sizes.seq_len / dims.cp * shape.micro_batch * sizes.hidden * shape.element_bytes
    tp_messages = TP_ALL_REDUCES_PER_LAYER * share.layers * micro_batches
    tp_bytes = tp_messages * ring_factor(dims.tp, all_reduce=True) * activation if dims.tp > 1 else 0.0
    cp_messages = CP_ALL_TO_ALLS_PER_LAYER * share.layers * micro_batches
    cp_bytes = cp_messages * ring_factor(dims.cp, all_reduce=False) * activation / dims.tp
    pp_messages = 2 * micro_batches
    pp_bytes = pp_messages * activation if dims.pp > 1 else 0.0
    return (
        _sent(tp_bytes, dims, "tp", gpus_per_node=gpus_per_node, messages=tp_messages)
        + _sent(cp_bytes, dims, "cp", gpus_per_node=gpus_per_node, messages=cp_messages)
        + _sent(pp_bytes, dims, "pp", gpus_per_node=gpus_per_node, messages=pp_messages)
    )
