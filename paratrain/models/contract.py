"""The model contract: the optional methods ("hooks") a model may define to tell paratrain more about it.

A model is a plain ``nn.Module``; every hook is optional. Each is a ``runtime_checkable`` Protocol here,
documenting its signature, when paratrain calls it and what it returns, beside ``ParallelPlan``, the data
the plan hook returns. Nothing else in paratrain names a hook: code asks ``isinstance(model, Hook)`` or
calls an accessor below, so a hook is defined, looked up and documented in this one file.

A method whose name is one edit away from a hook's (``paralel_plan``, ``init_parameters``) would
otherwise be silently ignored: ``misspelt_hooks`` names it and the hook it resembles, and the model's
build warns once on rank 0 (the dry run prints it too).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import nn

logger = logging.getLogger("paratrain")

# colwise/rowwise: Megatron's pair (a split output feeds a split input; one all-reduce). The rest are styles
# transformers' tp_plans use: colwise_gather_output gathers the split output (what follows needs whole
# features), rowwise_split_input takes a whole input and splits it, replicated_with_grad_allreduce keeps a
# per-head parameter (Qwen3's q_norm/k_norm) whole on every rank and sums its gradient over them.
TensorParallelStyle = Literal[
    "colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "replicated_with_grad_allreduce"
]


@dataclass(frozen=True)
class ParallelPlan:
    """How a model may be split.

    Attributes:
        blocks: Module paths (as in ``model.get_submodule``) of the repeated blocks, in forward order.
        block_tp_plan: Tensor-parallel style of linear layers inside each block, by path relative
            to the block: "colwise" splits output features, "rowwise" input features (Megatron style:
            a colwise layer feeds a rowwise one, so each pair needs one all-reduce); the other
            ``TensorParallelStyle`` values are transformers' variants (see there).
        block_norms: Paths of each block's norm layers, relative to the block, that sequence
            parallel shards along the sequence dimension.
        tp_divisible: Sizes a tensor-parallel degree must divide, by the config key that sets them
            (e.g. ``{"model.args.n_head": 4}``).
        pipeline_sequence: Module paths whose chained calls, ``x = module(x)`` in this order, compute
            exactly what the model's forward computes. Pipeline stages and model-parallel parts are cut
            between them, so together they must hold every parameter. ``nn.Sequential`` models get
            their children by default.
        tp_unsupported: Entries of a transformers model's own tensor-parallel plan inside its blocks
            whose style paratrain does not apply (``path: style``); tensor parallel is refused naming them.
        pipeline_layer_inputs: For pieces that take more than ``x`` (transformers' decoder layers: rotary
            embeddings and causal mask), an object whose ``layers`` names them, whose ``modules`` every
            stage must hold, and whose ``compute(x)`` gives each one's keyword inputs (see
            models/hf_pipeline.py). None: every piece takes ``x`` alone.
        pipeline_refusal: Why the model cannot be cut into pipeline stages, when paratrain knows.
        attention_heads: The attention's query and key/value head counts, by the config key that sets them:
            context parallel's all-to-all splits heads over cp ranks (after tensor parallel's split), so
            cp x tp must divide each.
        outer_units: Groups of modules outside the blocks that FSDP shards as one unit each, before the
            root takes what is left: a transformers model's input embedding, and its final norm with
            its head (as Accelerate and torchtitan do), so the embedding is freed after forward instead
            of staying gathered with the head. Empty: the root holds them.
        block_experts: Paths, relative to each block, of the modules holding a mixture of experts' stacked
            weights (every parameter's dim 0 is the expert): expert parallel gives each ep rank whole
            experts along it, and FSDP shards them over the data-parallel ranks ep leaves.
        num_experts: The experts per block, by the config key that sets them: ep must divide it.
        expert_refusal: Why expert parallel cannot divide the model's experts, when paratrain knows (a
            transformers family whose experts module its dispatch was not checked against).
        tp_left_whole: Entries of a transformers model's own tensor-parallel plan for its experts
            (``path: style``) that tensor parallel leaves out: the experts stay whole on every tp rank, as
            paratrain's GPT's do, and expert parallel divides them.
    """

    blocks: tuple[str, ...] = ()
    block_tp_plan: Mapping[str, TensorParallelStyle] = field(default_factory=dict)
    block_norms: tuple[str, ...] = ()
    tp_divisible: Mapping[str, int] = field(default_factory=dict)
    pipeline_sequence: tuple[str, ...] = ()
    tp_unsupported: tuple[str, ...] = ()
    pipeline_layer_inputs: Any = None
    pipeline_refusal: str = ""
    outer_units: tuple[tuple[str, ...], ...] = ()
    attention_heads: Mapping[str, int] = field(default_factory=dict)
    block_experts: tuple[str, ...] = ()
    num_experts: Mapping[str, int] = field(default_factory=dict)
    expert_refusal: str = ""
    tp_left_whole: tuple[str, ...] = ()

    def describe_outer_units(self) -> str:
        """``model.embed_tokens; model.norm + lm_head``, or "" when there are none (logs, the dry run)."""
        return "; ".join(" + ".join(group) for group in self.outer_units)


@runtime_checkable
class DeclaresParallelPlan(Protocol):
    """``parallel_plan(self) -> ParallelPlan``: how the model may be cut (its blocks, the tensor-parallel
    style of their linear layers, its pipeline sequence), as data.

    Called on the model as built (on the meta device in sharded layouts), before any parallelism is
    applied: by every layout (``parallelize``, the pipeline's stage cut), by the launcher's checks, the
    planner and ``--dry-run``. Without it, an ``nn.Sequential``'s children are its pipeline sequence and a
    transformers model's plan is derived from its ``_no_split_modules``, ``tp_plan`` and ``pp_plan``; any
    other model has an empty plan (tensor and pipeline parallel are refused, FSDP shards it as one unit).
    """

    def parallel_plan(self) -> ParallelPlan: ...


@runtime_checkable
class InitialisesParameters(Protocol):
    """``init_parameter(self, name, tensor, generator) -> None``: fills ``tensor`` in place with the initial
    values of the parameter or buffer called ``name`` (as ``named_parameters``/``named_buffers`` spell it),
    drawing random numbers only from ``generator`` (None when the model calls it itself).

    Called once per tensor, on the full unsharded tensor in host memory, when a model built on the meta
    device is materialised (sharded layouts, and unsharded ones for a model that declares it), with a
    generator seeded by ``(train.seed, name)``: every layout starts from the same weights and no rank ever
    holds the whole model. Not called when ``model.pretrained`` gives the weights. Without it, the model
    is built once for real on the CPU after seeding, and each rank keeps its slice.
    """

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator | None) -> None: ...


@runtime_checkable
class CountsFlopsPerSample(Protocol):
    """``flops_per_sample(self) -> float``: training FLOPs (forward and backward) of one sample.

    Called once at train start by the ``ThroughputMonitor`` callback (unless its own ``flops_per_sample``
    argument is given) for achieved FLOP/s and MFU; preferred over ``flops_per_token``.
    """

    def flops_per_sample(self) -> float: ...


@runtime_checkable
class CountsFlopsPerToken(Protocol):
    """``flops_per_token(self, seq_len) -> float``: training FLOPs (forward and backward) per token at
    sequence length ``seq_len`` (the tokens per sample).

    Called once at train start by the ``ThroughputMonitor`` callback, which multiplies it by the tokens per
    sample. Without either FLOPs hook the monitor counts 6·N per token, N every parameter.
    """

    def flops_per_token(self, seq_len: int) -> float: ...


@runtime_checkable
class UsesSequenceFunctions(Protocol):
    """``use_sequence_functions(self, *, attention, positions) -> None``: replaces the model's attention
    kernel and the source of its token positions.

    Called once, before any parallelism is applied, by layouts that change what attention sees: context
    parallel (each rank holds a slice of every sequence) and document masking. ``attention(q, k, v, *,
    dropout_p=0.0, scale=None, sliding_window=None)`` takes and returns ``(batch, heads, tokens, head_dim)``
    tensors (key and value may have fewer heads) and is causal; ``positions(tokens)`` gives the
    ``(batch or 1, tokens)`` positions of the token ids a forward was given. Without the hook those
    layouts are refused (transformers models get it from paratrain, through their attention interface).
    """

    def use_sequence_functions(self, *, attention: Any, positions: Any) -> None: ...


@runtime_checkable
class DispatchesToExperts(Protocol):
    """``use_expert_dispatch(self, dispatch) -> None``: replaces how the model's mixture-of-experts layers
    hand tokens to their experts.

    Called once, before any parallelism is applied, by expert parallel (``parallel.ep``), whose ranks each
    hold whole experts (``num_experts / ep`` of them: the leading dimension of the stacked expert weights
    the plan's ``experts`` name). ``dispatch(experts, x, counts)`` takes the layer's ``experts`` module,
    ``x`` the ``(assignments, dim)`` token copies sorted by expert and ``counts`` the ``(num_experts,)``
    assignments per expert, and returns each assignment's expert output in the same order; the default
    computes every expert locally. ``experts(x, index)`` applies the rank's expert ``index`` (counted among
    those it holds). Without the hook expert parallel is refused.
    """

    def use_expert_dispatch(self, dispatch: Any) -> None: ...


@dataclass(frozen=True)
class RoutingStats:
    """What a mixture-of-experts layer routed over some training forwards (``RoutesTokens``).

    Attributes:
        tokens_per_expert: (num_experts,) token assignments each expert computed, or (layers, num_experts)
            from one object reporting several layers (a transformers model's ``RoutingRecorder``).
        dropped: 0-d count of the assignments dropped over an expert's capacity.
        aux_loss: 0-d sum of the forwards' load-balancing losses (unweighted).
        forwards: How many forwards' load-balancing losses are summed (0: the model computes none).
        balance_bias: The layer balances its experts with a per-expert bias (``BalancesExperts``): after
            every step it is handed the step's ``tokens_per_expert`` summed over every rank.
    """

    tokens_per_expert: torch.Tensor
    dropped: torch.Tensor
    aux_loss: torch.Tensor
    forwards: int
    balance_bias: bool = False

    def plus(self, other: RoutingStats) -> RoutingStats:
        return RoutingStats(
            self.tokens_per_expert + other.tokens_per_expert,
            self.dropped + other.dropped,
            self.aux_loss + other.aux_loss,
            self.forwards + other.forwards,
            self.balance_bias,
        )


@runtime_checkable
class RoutesTokens(Protocol):
    """``pop_routing_stats(self) -> RoutingStats | None``: on a model's mixture-of-experts layers (any
    submodule, not the model itself), what the layer routed in the training forwards since the last call,
    then forgotten (None when it ran none).

    Called on every rank after every optimizer step by the router-statistics callback the trainer adds
    when a model has such layers; on log steps it reduces them across ranks into ``moe_aux_loss`` and
    ``moe_expert_tokens_min``/``_max`` (and ``moe_dropped_tokens``) of the metrics record.
    """

    def pop_routing_stats(self) -> RoutingStats | None: ...


@runtime_checkable
class BalancesExperts(Protocol):
    """``update_expert_bias(self, tokens_per_expert) -> None``: on a ``RoutesTokens`` layer whose statistics say
    ``balance_bias``, aux-loss-free balancing: called on every rank after every optimizer step with the
    tokens each expert computed in that step (the layer's ``tokens_per_expert`` summed over the data-parallel
    and context-parallel ranks), so that every rank moves its per-expert bias the same way.
    """

    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None: ...


HOOKS: tuple[type, ...] = (
    DeclaresParallelPlan,
    InitialisesParameters,
    CountsFlopsPerSample,
    CountsFlopsPerToken,
    UsesSequenceFunctions,
    DispatchesToExperts,
)


def hook_name(hook: type) -> str:
    """The method a hook Protocol asks for: each declares exactly one."""
    (name,) = [name for name, value in vars(hook).items() if callable(value) and not name.startswith("_")]
    return name


def declared_plan(model: nn.Module) -> ParallelPlan | None:
    """The plan the model declares through its plan hook, or None when it has none."""
    return model.parallel_plan() if isinstance(model, DeclaresParallelPlan) else None


def declares_init(model: nn.Module) -> bool:
    """Whether the model initialises its own tensors by name (the parameter-initialisation hook)."""
    return isinstance(model, InitialisesParameters)


def provided_hooks(model: nn.Module) -> list[str]:
    """The names of the hooks the model defines, in HOOKS order."""
    return [hook_name(hook) for hook in HOOKS if isinstance(model, hook)]


def misspelt_hooks(model: nn.Module) -> list[str]:
    """One message per method of the model's class whose name is one edit (a letter added, dropped or
    changed) away from a hook's name, naming both: paratrain would otherwise ignore it without a word."""
    hooks = [hook_name(hook) for hook in HOOKS]
    kind = type(model)
    messages = []
    for name in sorted(dir(kind)):
        if name in hooks or name.startswith("__") or not callable(getattr(kind, name, None)):
            continue
        for hook in hooks:
            if _one_edit_apart(name, hook):
                messages.append(
                    f"model {kind.__name__} defines {name}(), one letter away from the hook {hook}(), which "
                    f"paratrain calls by that exact name: {name}() is ignored; rename it to {hook} if it is meant "
                    f"as the hook (see paratrain/models/contract.py)"
                )
    return messages


def warn_misspelt_hooks(model: nn.Module) -> None:
    """Logs misspelt_hooks' messages as warnings (the caller calls it once, on rank 0, when it builds the model)."""
    for message in misspelt_hooks(model):
        logger.warning("%s", message)


def _one_edit_apart(a: str, b: str) -> bool:
    """Levenshtein distance exactly 1: one insertion, deletion or substitution turns a into b."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) > len(b):
        a, b = b, a
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            skip = index if len(a) == len(b) else index - 1
            return a[skip + 1 :] == b[index + 1 :]
    return True  # b is a with one letter appended
