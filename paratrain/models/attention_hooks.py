"""Giving a model a layout's attention and position functions (context parallel, document masking).

paratrain's GPT takes them through its ``use_sequence_functions`` hook (models/contract.py). A
transformers model takes them through its own extension points, so its code is not patched: the
attention through transformers' ``AttentionInterface`` (registered under one name, which the model's
config then selects; no mask is built for a registered name, and the function applies its own), and
the positions through a pre-hook on its rotary embedding, which every decoder layer's positions come
from. What cannot take them is refused with the reason, before anything is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.models.contract import UsesSequenceFunctions
from paratrain.models.hf import is_transformers_model, require_transformers

ATTENTION_NAME = "paratrain_sequence"

AttentionFn = Callable[..., torch.Tensor]
PositionsFn = Callable[[torch.Tensor], torch.Tensor]


def sequence_refusal(model: nn.Module) -> str:
    """Why the model's attention and positions cannot be replaced, or "" when they can."""
    if isinstance(model, UsesSequenceFunctions):
        return ""
    if not is_transformers_model(model):
        return (
            f"model {type(model).__name__} does not define use_sequence_functions(attention=, positions=) "
            "(see paratrain/models/contract.py), so paratrain cannot give its attention the other ranks' "
            "tokens or the document mask"
        )
    if not getattr(model, "_supports_attention_backend", False):
        return (
            f"transformers' {type(model).__name__} does not route attention through AttentionInterface "
            "(_supports_attention_backend is False)"
        )
    if not _rotary_modules(model):
        return f"transformers' {type(model).__name__} has no rotary embedding module to take positions from"
    return ""


def install_sequence_functions(model: nn.Module, *, attention: AttentionFn, positions: PositionsFn) -> None:
    """Makes every attention layer of ``model`` call ``attention`` and its positions come from ``positions``.

    Raises:
        ConfigError: the model cannot take them (``sequence_refusal``'s reason).
    """
    refusal = sequence_refusal(model)
    if refusal:
        raise ConfigError(refusal)
    if isinstance(model, UsesSequenceFunctions):
        model.use_sequence_functions(attention=attention, positions=positions)
        return
    _install_on_transformers(model, attention, positions)


def _install_on_transformers(model: nn.Module, attention: AttentionFn, positions: PositionsFn) -> None:
    transformers = require_transformers()
    transformers.AttentionInterface.register(ATTENTION_NAME, _transformers_attention)
    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            module.paratrain_attention = attention
    model.config._attn_implementation = ATTENTION_NAME
    for rotary in _rotary_modules(model):
        rotary.register_forward_pre_hook(_positions_hook(positions), with_kwargs=True)


def _transformers_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature around paratrain's: ``(batch, heads, tokens, dim)`` in,
    ``(batch, tokens, heads, dim)`` out. The mask transformers would build is not built (a registered
    name has none) and padding is not supported: paratrain's samples are full windows."""
    for unsupported in ("softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ConfigError(
                f"{type(module).__name__} uses attention {unsupported}, which context parallel and document "
                "masking do not apply; turn parallel.cp and data.args.document_mask off for this model"
            )
    output = module.paratrain_attention(
        query, key, value, dropout_p=dropout, scale=scaling, sliding_window=sliding_window
    )
    return output.transpose(1, 2).contiguous(), None


def _positions_hook(positions: PositionsFn) -> Callable:
    """A rotary embedding's forward(hidden, position_ids) gets this rank's positions instead of 0, 1, ..."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = args[0] if args else kwargs["x"]
        ids = positions(hidden[..., 0])
        if len(args) > 1:
            return (args[0], ids, *args[2:]), kwargs
        return args, {**kwargs, "position_ids": ids}

    return hook


def _rotary_modules(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if type(module).__name__.endswith("RotaryEmbedding")]
