"""Memory per rank of one layout: ZeRO-style model-state accounting (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models") plus activations and the working set a layout
gathers. Formulas: docs/planner.md.

paratrain keeps parameters, gradients and optimizer state in fp32 under every ``precision``
(autocast lowers only the compute; FSDP's ``param_dtype`` only the gathered copies), so model state
is 4 + 4 + optimizer bytes per parameter a rank holds: 16Ψ for AdamW under DDP, 16Ψ/N under FSDP.
float8 training (``parallel.float8``) changes none of it either: torchao's Float8Linear keeps the fp32
master weight and casts a copy for each matmul. What it changes is the gathered working set (below).
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config.schema import FSDPConfig, OptimConfig
from paratrain.parallel.dims import ParallelDims, micro_batch_size
from paratrain.parallel.float8 import gathers_in_float8
from paratrain.planner.activations import ActivationShape, head_bytes, layers_bytes, recompute_bytes
from paratrain.planner.inputs import PlanInputs
from paratrain.planner.model_facts import ModelFacts, ParamFacts

FP32 = 4
FLOAT8 = 1
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds, by kind. ``working`` is what the layout gathers or keeps unsharded for
    a while (FSDP's gathered parameters and not yet reduced gradients, DDP's separate buckets)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    working: int

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.model_state + self.activations + self.working


@dataclass(frozen=True)
class StageShare:
    """What one pipeline rank holds: its pieces, their parameters and transformer layers."""

    pp_rank: int
    pieces: tuple[str, ...]
    params: tuple[ParamFacts, ...]
    layers: int
    has_head: bool  # holds the last piece, so computes the logits and the loss
    whole_model: bool = False  # no pipeline: every module, whether or not the model has a pipeline sequence

    def holds(self, path: str) -> bool:
        """Whether this share holds the module at ``path`` (a block, a piece, an outer unit's module)."""
        return self.whole_model or path in self.pieces


def fsdp_degree(dims: ParallelDims) -> int:
    """Ranks each parameter is cut across by FSDP (1 when the layout does not use it): dp_shard x cp."""
    return dims.fsdp_size


def model_state_bytes(
    params: list[ParamFacts] | tuple[ParamFacts, ...], *, dims: ParallelDims, optim: OptimConfig
) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes one rank holds for these parameters; frozen ones (a LoRA
    run's base) have no gradient or optimizer state."""
    numel = sum(held_numel(param, dims) for param in params)
    trainable = [param for param in params if param.trainable]
    trained = sum(held_numel(param, dims) for param in trainable)
    return FP32 * numel, FP32 * trained, optimizer_bytes(trained, num_tensors=len(trainable), optim=optim)


def held_numel(param: ParamFacts, dims: ParallelDims) -> int:
    """Elements of ``param`` one rank stores: an expert tensor under expert parallel is its ep share, sharded
    over the efsdp ranks holding the same experts; every other parameter is sharded over dp_shard x cp."""
    if param.expert and dims.ep_enabled:
        return param.local_numel(tp=dims.tp, dp_shard=dims.efsdp, ep=dims.ep)
    return param.local_numel(tp=dims.tp, dp_shard=fsdp_degree(dims))


def optimizer_bytes(numel: int, *, num_tensors: int, optim: OptimConfig) -> int:
    """AdamW: exp_avg and exp_avg_sq in fp32, and a 4-byte ``step`` per parameter tensor.
    SGD: one fp32 momentum buffer with momentum, nothing without."""
    if optim.name == "adamw":
        return 2 * FP32 * numel + FP32 * num_tensors
    return FP32 * numel if optim.momentum > 0 else 0


def stage_shares(facts: ModelFacts, inputs: PlanInputs, dims: ParallelDims) -> list[StageShare]:
    """Each pipeline rank's share; one share holding everything without a pipeline."""
    sequence = facts.plan.pipeline_sequence
    if dims.pp == 1:
        return [StageShare(0, sequence, facts.params, len(facts.plan.blocks), True, whole_model=True)]
    # lazy: pipeline building loads torch.distributed.pipelining (torch._dynamo) only for pp layouts
    from paratrain.parallel.pipeline.assembly import pipeline_shape  # loads torch.distributed.pipelining: pp only
    from paratrain.parallel.pipeline.split import cut_stages

    shape = pipeline_shape(inputs.pipeline, dims=dims, train=inputs.train)
    stages = cut_stages(facts.model, inputs.pipeline, shape.num_stages)
    shares = []
    for pp_rank in range(dims.pp):
        pieces = tuple(piece for index in shape.stages_of_rank(pp_rank) for piece in stages[index])
        shares.append(
            StageShare(pp_rank, pieces, tuple(facts.params_in(pieces)), facts.blocks_in(pieces), sequence[-1] in pieces)
        )
    return shares


def micro_batches_in_flight(inputs: PlanInputs, dims: ParallelDims) -> int:
    """Micro-batches whose activations a rank holds at once: 1 without a pipeline (each backward frees
    its micro-batch), all m under GPipe, at most p under 1F1B and the other schedules (first stage)."""
    if dims.pp == 1:
        return 1
    microbatches = inputs.train.global_batch_size // (
        micro_batch_size(inputs.train, inputs.pipeline, dims=dims) * dims.dp
    )
    return microbatches if inputs.pipeline.schedule == "GPipe" else min(dims.pp, microbatches)


def activation_shape(inputs: PlanInputs, dims: ParallelDims) -> ActivationShape:
    return ActivationShape(
        micro_batch=micro_batch_size(inputs.train, inputs.pipeline, dims=dims),
        element_bytes=DTYPE_BYTES[inputs.precision],
        tp=dims.tp,
        sequence_parallel=inputs.parallel.sequence_parallel and dims.tp > 1,
        checkpointing=inputs.parallel.activation_checkpointing,
        cp=dims.cp,
        checkpoint_every=inputs.parallel.activation_checkpointing_every,
    )


def activation_bytes(
    facts: ModelFacts, share: StageShare, inputs: PlanInputs, dims: ParallelDims, *, measured_per_sample: float | None
) -> int:
    """Activations of one pipeline rank: the transformer formula, or for other models the bytes measured
    per sample on the meta device (fp32), scaled by micro-batch, compute dtype and the share of parameters."""
    shape = activation_shape(inputs, dims)
    in_flight = micro_batches_in_flight(inputs, dims)
    sizes = facts.transformer
    if sizes is not None:
        held = layers_bytes(sizes, shape, num_layers=share.layers) * in_flight
        return int(held + recompute_bytes(sizes, shape) + (head_bytes(sizes, shape) if share.has_head else 0))
    if measured_per_sample is None:
        return 0
    fraction = sum(param.numel for param in share.params) / facts.num_params
    return int(measured_per_sample * shape.micro_batch * shape.element_bytes / FP32 * fraction * in_flight)


def working_bytes(facts: ModelFacts, share: StageShare, inputs: PlanInputs, dims: ParallelDims) -> int:
    """FSDP: the root's parameters (kept gathered from forward into backward), two blocks gathered at once
    (the one computing and the one prefetched), and one block's unsharded gradient before its reduce-scatter;
    under grad_sync=last_micro_batch with accumulation, every unsharded gradient between micro-batches.
    DDP without gradient_as_bucket_view: a second copy of the gradients in its buckets."""
    parallel = inputs.parallel
    if dims.ddp_enabled and not parallel.ddp.gradient_as_bucket_view:
        return FP32 * sum(param.numel for param in share.params)
    if not dims.fsdp_enabled:
        return 0
    float8 = gathers_in_float8(parallel.float8, fsdp=True, tp=dims.tp)
    return _fsdp_working_bytes(
        facts, share, parallel.fsdp, dims=dims, accumulating=_accumulates(inputs, dims), float8=float8
    )


def _fsdp_working_bytes(
    facts: ModelFacts, share: StageShare, fsdp: FSDPConfig, *, dims: ParallelDims, accumulating: bool, float8: bool
) -> int:
    reduced = DTYPE_BYTES[fsdp.resolved_reduce_dtype() or "fp32"]

    def size(params) -> int:
        return gathered_bytes(params, dims, fsdp, float8=float8)

    # Units gathered in turn: the blocks, and the outer groups but the last (the embedding); the last outer
    # group (final norm and head) stays gathered from forward into backward, as the root does.
    outer = [facts.params_in(group) for group in facts.plan.outer_units if all(share.holds(path) for path in group)]
    units = [*(facts.params_in([block]) for block in facts.plan.blocks if share.holds(block)), *outer[:-1]]
    streamed = sorted(units, key=size, reverse=True)
    kept = size(share.params) - sum(map(size, streamed))  # the root's parameters and the last outer group
    everything = gathered_numel(share.params, dims)
    if not streamed:  # the model is one unit: gathered whole
        return size(share.params) + reduced * everything
    # Gradients are never float8: a unit's unsharded gradient has its elements at reduce_dtype's size.
    largest_gradient = max(gathered_numel(unit, dims) for unit in streamed)
    held_gradients = everything if accumulating and fsdp.grad_sync == "last_micro_batch" else largest_gradient
    return kept + sum(map(size, streamed[:2])) + reduced * held_gradients


def gathered_numel(params, dims: ParallelDims) -> int:
    """Elements a rank computes with once FSDP has gathered them: its tensor-parallel piece, and of expert
    tensors its ep share."""
    return sum(param.local_numel(tp=dims.tp, ep=dims.ep) for param in params)


def gathered_bytes(params, dims: ParallelDims, fsdp: FSDPConfig, *, float8: bool) -> int:
    """Bytes FSDP all-gathers of these parameters (``gathered_numel``'s elements): param_dtype's size each
    (fp32 when unset), except the weights float8 training converts when they are gathered in float8
    (``float8``: tensorwise scaling with fsdp_float8_all_gather), 1 byte each: half of bf16's. Their scales
    (one fp32 per tensor) are left out."""
    element = DTYPE_BYTES[fsdp.param_dtype] if fsdp.param_dtype else FP32
    return sum(
        param.local_numel(tp=dims.tp, ep=dims.ep) * (FLOAT8 if float8 and param.float8 else element) for param in params
    )


def _accumulates(inputs: PlanInputs, dims: ParallelDims) -> bool:
    """More than one micro-batch per step on a rank (outside a pipeline, which accumulates itself)."""
    return dims.pp == 1 and inputs.train.global_batch_size > inputs.train.micro_batch_size * dims.dp


def rank_memory(
    facts: ModelFacts, share: StageShare, inputs: PlanInputs, dims: ParallelDims, *, measured_per_sample: float | None
) -> RankMemory:
    """Everything one rank of this pipeline rank's share holds (the same on every data/tensor-parallel rank,
    up to FSDP's padding: this is rank 0's, the largest)."""
    params, grads, optimizer = model_state_bytes(share.params, dims=dims, optim=inputs.optim)
    return RankMemory(
        params,
        grads,
        optimizer,
        activation_bytes(facts, share, inputs, dims, measured_per_sample=measured_per_sample),
        working_bytes(facts, share, inputs, dims),
    )
