"""Context-parallel, document-masking and sample-packing settings checked before any process starts: each
refusal names the keys, the numbers and the fix."""

from __future__ import annotations

import inspect

from torch import nn

from paratrain.config.factories import resolve_factory
from paratrain.config.schema import DataConfig, ParallelConfig
from paratrain.errors import ConfigError
from paratrain.models.attention_hooks import sequence_refusal
from paratrain.models.plan_derivation import plan_of
from paratrain.parallel.dims import ParallelDims

# The models whose attention keeps to each document and whose positions restart (models/attention_hooks.py).
SUPPORTED = (
    "paratrain's GPT, and transformers models that route attention through AttentionInterface and take positions "
    "from a rotary embedding: Llama, Mistral, Qwen2, Qwen3, Gemma and the like"
)


def check_sequence_layout(parallel: ParallelConfig, data: DataConfig, dims: ParallelDims, *, model: nn.Module) -> None:
    """Raises ConfigError when parallel.cp, data.args.document_mask or packed samples (a data factory's
    ``pack``) cannot run on ``model`` (built on meta).

    Checked: the exchange (ring needs CUDA kernels paratrain does not drive yet), the model's attention
    (it must take paratrain's: models/attention_hooks.py), the heads (cp x tp divides each head count), the
    sequence length (2 x cp equal chunks) and documents beside a pipeline.
    """
    packed = packs_samples(data)
    documents = bool(data.args.get("document_mask")) or packed
    if not (dims.cp_enabled or documents):
        return
    asking = (
        f"parallel.cp={dims.cp}"
        if dims.cp_enabled
        else ("data.args.pack=true (packing samples)" if packed else "data.args.document_mask=true")
    )
    if dims.cp_enabled and parallel.cp_attention == "ring":
        raise ConfigError(
            "parallel.cp_attention=ring: torch's ring attention runs only on CUDA's SDPA kernels and paratrain "
            "does not drive it yet; set parallel.cp_attention=all_to_all (or auto), which works on every device"
        )
    refusal = sequence_refusal(model)
    if refusal:
        fix = "set data.args.pack=false" if packed and not dims.cp_enabled else f"remove {asking.split('=')[0]}"
        raise ConfigError(f"{asking}: {refusal}; {fix}, or use a model that can take it ({SUPPORTED})")
    if documents and dims.pp_enabled:
        key = "data.args.pack" if packed else "data.args.document_mask"
        raise ConfigError(
            f"{key}=true with parallel.pp={dims.pp}: a pipeline's stages cannot be given each micro-batch's "
            f"documents yet; set {key}=false or remove parallel.pp"
        )
    _check_heads(model, dims)
    _check_sequence_length(data, dims)


def packs_samples(data: DataConfig) -> bool:
    """Whether the data factory packs samples into rows: its ``pack`` argument, as given or by its default."""
    if "pack" in data.args:
        return bool(data.args["pack"])
    try:
        parameter = inspect.signature(resolve_factory(data.factory, key="data.factory")).parameters.get("pack")
    except (ConfigError, TypeError, ValueError):  # a factory that does not resolve is reported by its own check
        return False
    return parameter is not None and parameter.default is True


def _check_heads(model: nn.Module, dims: ParallelDims) -> None:
    split = dims.cp * dims.tp
    for key, heads in plan_of(model).attention_heads.items():
        if heads % split:
            raise ConfigError(
                f"parallel.cp={dims.cp} x parallel.tp={dims.tp} = {split} does not divide {key}={heads}: the "
                f"all-to-all gives each cp rank whole heads of its tensor-parallel share; choose cp and tp whose "
                f"product divides {heads}"
            )


def _check_sequence_length(data: DataConfig, dims: ParallelDims) -> None:
    key = "seq_len" if "seq_len" in data.args else "block_size"
    seq_len = data.args.get(key)
    if dims.cp_enabled and isinstance(seq_len, int) and seq_len % (2 * dims.cp):
        raise ConfigError(
            f"data.args.{key}={seq_len} is not divisible by 2 x parallel.cp = {2 * dims.cp}: each cp rank holds "
            f"an early and a late chunk of every sequence; use a {key} that is a multiple of {2 * dims.cp}"
        )
