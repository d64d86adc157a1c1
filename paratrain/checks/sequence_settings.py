"""Context-parallel and document-masking settings checked before any process starts: each refusal names
the keys, the numbers and the fix."""

from __future__ import annotations

from torch import nn

from paratrain.config.schema import DataConfig, ParallelConfig
from paratrain.errors import ConfigError
from paratrain.models.attention_hooks import sequence_refusal
from paratrain.models.plan_derivation import plan_of
from paratrain.parallel.dims import ParallelDims


def check_sequence_layout(parallel: ParallelConfig, data: DataConfig, dims: ParallelDims, *, model: nn.Module) -> None:
    """Raises ConfigError when parallel.cp or data.args.document_mask cannot run on ``model`` (built on meta).

    Checked: the exchange (ring needs CUDA kernels paratrain does not drive yet), the model's attention
    (it must take paratrain's: models/attention_hooks.py), the heads (cp x tp divides each head count), the
    sequence length (2 x cp equal chunks) and document masking beside a pipeline.
    """
    documents = bool(data.args.get("document_mask"))
    if not (dims.cp_enabled or documents):
        return
    asking = f"parallel.cp={dims.cp}" if dims.cp_enabled else "data.args.document_mask=true"
    if dims.cp_enabled and parallel.cp_attention == "ring":
        raise ConfigError(
            "parallel.cp_attention=ring: torch's ring attention runs only on CUDA's SDPA kernels and paratrain "
            "does not drive it yet; set parallel.cp_attention=all_to_all (or auto), which works on every device"
        )
    refusal = sequence_refusal(model)
    if refusal:
        raise ConfigError(f"{asking}: {refusal}; remove {asking.split('=')[0]} or use a model that can take it")
    if documents and dims.pp_enabled:
        raise ConfigError(
            f"data.args.document_mask=true with parallel.pp={dims.pp}: a pipeline's stages cannot be given each "
            "micro-batch's document mask yet; remove data.args.document_mask or parallel.pp"
        )
    _check_heads(model, dims)
    _check_sequence_length(data, dims)


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
    seq_len = data.args.get("block_size")
    if dims.cp_enabled and isinstance(seq_len, int) and seq_len % (2 * dims.cp):
        raise ConfigError(
            f"data.args.block_size={seq_len} is not divisible by 2 x parallel.cp = {2 * dims.cp}: each cp rank holds "
            f"an early and a late chunk of every sequence; use a block_size that is a multiple of {2 * dims.cp}"
        )
