"""What the planner knows about a model, read from one build on the meta device (no memory): every
parameter's shape, which of them tensor parallel splits and how, the pipeline pieces, and the
transformer sizes its activation formula needs."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from paratrain.config.factories import call_factory
from paratrain.config.schema import ModelConfig
from paratrain.errors import ConfigError
from paratrain.models.lora import maybe_apply_lora
from paratrain.models.meta import on_meta
from paratrain.models.plan_derivation import ParallelPlan, TensorParallelStyle, plan_of
from paratrain.parallel.float8 import float8_linear_paths


@dataclass(frozen=True)
class ParamFacts:
    """One parameter: its full shape and how tensor parallel splits it (None: replicated)."""

    name: str
    shape: tuple[int, ...]
    tp_style: TensorParallelStyle | None = None
    expert: bool = False  # stacked experts along dim 0 (ParallelPlan.block_experts): expert parallel divides it
    trainable: bool = True  # False: frozen (a LoRA run's base), so no gradient or optimizer state
    float8: bool = False  # the weight of a Linear layer parallel.float8 converts (parallel/float8.py)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_numel(self, *, tp: int = 1, dp_shard: int = 1, ep: int = 1) -> int:
        """Elements one rank holds: tensor parallel splits a colwise weight or bias on dim 0 and a
        rowwise weight on dim 1 (a rowwise bias stays whole); expert parallel gives each of ``ep`` ranks
        its share of an expert tensor's experts; FSDP then cuts dim 0 of that piece into ``dp_shard`` parts,
        padded up (FSDP2's uneven shards: rank 0 holds the largest)."""
        shape = list(self.shape) or [1]
        if self.expert:
            shape[0] //= ep
        if tp > 1 and self.tp_style == "colwise":
            shape[0] //= tp
        elif tp > 1 and self.tp_style == "rowwise" and len(shape) > 1:
            shape[1] //= tp
        shape[0] = -(-shape[0] // dp_shard)
        return math.prod(shape)


@dataclass(frozen=True)
class TransformerSizes:
    """Sizes of a decoder-only transformer, for the activation formula (see docs/planner.md). The defaults
    of the last fields are paratrain's GPT block: as many key/value heads as heads, a 4 x hidden GELU MLP."""

    num_layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    moe_layers: int = 0  # blocks with a mixture-of-experts feed-forward
    experts_per_token: int = 0  # their router's top k: copies of each token sent to experts
    kv_heads: int | None = None  # grouped-query attention: fewer key/value heads (None: as many as heads)
    ffn_hidden: int | None = None  # the MLP's inner width (None: 4 x hidden)
    gated_mlp: bool = False  # a gated MLP (SwiGLU: gate and up projections), as Llama's


@dataclass(frozen=True)
class ModelFacts:
    """The model as the planner sees it.

    Attributes:
        model: The model on the meta device (pipeline stages are cut from it).
        params: Every parameter, in the model's order.
        plan: The parallel plan the model declares.
        transformer: Its sizes when it is GPT-like, else None.
    """

    model: nn.Module
    params: tuple[ParamFacts, ...]
    plan: ParallelPlan
    transformer: TransformerSizes | None

    @property
    def num_params(self) -> int:
        return sum(param.numel for param in self.params)

    @property
    def expert_params(self) -> int:
        """Elements of the stacked expert tensors (ParallelPlan.block_experts); 0 for a dense model."""
        return sum(param.numel for param in self.params if param.expert)

    def params_in(self, pieces: Iterable[str]) -> list[ParamFacts]:
        """Parameters that live in any of these module paths (a pipeline stage's pieces)."""
        prefixes = tuple(f"{piece}." for piece in pieces)
        return [param for param in self.params if param.name.startswith(prefixes)]

    def blocks_in(self, pieces: Iterable[str]) -> int:
        """How many of the model's blocks (transformer layers) these pieces hold."""
        pieces = set(pieces)
        return sum(1 for block in self.plan.blocks if block in pieces)


def read_model_facts(model_config: ModelConfig, *, seq_len: int | None = None) -> ModelFacts:
    """Builds ``model.factory`` on the meta device and reads its sizes.

    Args:
        seq_len: Sequence length of the data, when the data config names one (else the model's block_size).

    Raises:
        ConfigError: the model does not build on the meta device, or has no parameters to count.
    """
    try:
        with on_meta():
            model = maybe_apply_lora(call_factory(model_config, key="model"), model_config.lora)
    except ConfigError:
        raise
    except Exception as error:  # the user's constructor may fail in any way on meta tensors
        raise ConfigError(
            f"model.factory={model_config.factory!r} does not build on the meta device ({type(error).__name__}: "
            f"{error}); the planner counts parameters without allocating them, so the constructor must not "
            f"need real tensor values or a fixed device"
        ) from None
    if not isinstance(model, nn.Module) or not any(True for _ in model.parameters()):
        raise ConfigError(
            f"model.factory={model_config.factory!r} gives a model with no size information (no parameters to "
            f"count); the planner needs an nn.Module whose parameters exist once it is constructed (not created "
            f"lazily in forward, e.g. nn.LazyLinear)"
        )
    if any(isinstance(param, nn.parameter.UninitializedParameter) for param in model.parameters()):
        raise ConfigError(
            f"model.factory={model_config.factory!r} has lazy parameters whose size is unknown until the first "
            f"forward; give every layer its sizes (nn.Linear instead of nn.LazyLinear) so the planner can count them"
        )
    plan = plan_of(model)
    return ModelFacts(model, tuple(_param_facts(model, plan)), plan, transformer_sizes(model, seq_len=seq_len))


def transformer_sizes(model: nn.Module, *, seq_len: int | None = None) -> TransformerSizes | None:
    """The sizes of paratrain's GPT or of a transformers decoder, from ``model.config``; None for other models."""
    config: Any = getattr(model, "config", None)
    if config is None:
        return None
    return _gpt_sizes(config, seq_len) or _transformers_sizes(model, config, seq_len)


def _gpt_sizes(config: Any, seq_len: int | None) -> TransformerSizes | None:
    """paratrain's GPT: n_layer, n_embd, n_head, block_size, vocab_size."""
    names = ("n_layer", "n_embd", "n_head", "block_size", "vocab_size")
    if not all(isinstance(getattr(config, name, None), int) for name in names):
        return None
    moe = getattr(config, "moe", None)
    top_k = getattr(moe, "top_k", 0)
    return TransformerSizes(
        config.n_layer,
        config.n_embd,
        config.n_head,
        seq_len or config.block_size,
        config.vocab_size,
        moe_layers=config.n_layer if top_k else 0,
        experts_per_token=top_k,
    )


def _transformers_sizes(model: nn.Module, config: Any, seq_len: int | None) -> TransformerSizes | None:
    """A transformers decoder (Llama, Qwen, Mistral, GPT-2, ...): its config's standard names (GPT-2's
    n_layer and n_embd answer to them through transformers' attribute_map), the sequence from the data or
    else max_position_embeddings. Gated is read off the parameters: a gate projection beside up and down."""
    names = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
    sizes = [getattr(config, name, None) for name in names]
    seq_len = seq_len or getattr(config, "max_position_embeddings", None)
    if not all(isinstance(value, int) for value in [*sizes, seq_len]):
        return None
    num_layers, hidden, heads, vocab = sizes
    ffn_hidden = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
    gated = any(".gate_proj." in name or ".gate_up_proj" in name for name, _ in model.named_parameters())
    return TransformerSizes(
        num_layers,
        hidden,
        heads,
        seq_len,
        vocab,
        kv_heads=getattr(config, "num_key_value_heads", None),
        ffn_hidden=ffn_hidden if isinstance(ffn_hidden, int) else None,
        gated_mlp=gated,
    )


def _param_facts(model: nn.Module, plan: ParallelPlan) -> Iterable[ParamFacts]:
    styles = {
        f"{block}.{layer}.{kind}": style
        for block in plan.blocks
        for layer, style in plan.block_tp_plan.items()
        for kind in ("weight", "bias")
    }
    experts = tuple(f"{block}.{path}." for block in plan.blocks for path in plan.block_experts)
    float8_weights = {f"{path}.weight" for path in float8_linear_paths(model, plan)}
    for name, param in model.named_parameters():
        style = styles.get(name)
        if style == "rowwise" and name.endswith(".bias"):
            style = None  # a rowwise layer adds its bias once, after the reduction: kept whole
        expert = bool(experts) and name.startswith(experts)
        yield ParamFacts(
            name, tuple(param.shape), style, expert=expert, trainable=param.requires_grad, float8=name in float8_weights
        )
