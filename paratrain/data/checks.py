"""Checks of the data against the model, run before any process starts: a token id or position the model
has no embedding for fails here with the keys to change, not as an IndexError inside a loader worker."""

from __future__ import annotations

from typing import Any

from torch import nn

from paratrain.errors import ConfigError


def model_positions(model: nn.Module) -> int | None:
    """The longest sequence the model embeds: ``config.block_size`` (paratrain's GPT) or
    ``config.max_position_embeddings`` (transformers); None when the model does not say."""
    config = getattr(model, "config", None)
    for name in ("block_size", "max_position_embeddings", "n_positions"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    return None


def model_vocab_size(model: nn.Module) -> int | None:
    value = getattr(getattr(model, "config", None), "vocab_size", None)
    return value if isinstance(value, int) else None


def check_data_fits_model(args: dict[str, Any], model: nn.Module, *, key: str = "data") -> None:
    """Refuses a ``block_size`` longer than the model's positions and a tokenizer with more tokens than its
    embedding.

    Raises:
        ConfigError: naming ``{key}.args.block_size`` or ``{key}.args.tokenizer`` and ``model.args``.
    """
    positions, block_size = model_positions(model), args.get("block_size")
    if isinstance(block_size, int) and positions is not None and block_size > positions:
        raise ConfigError(
            f"{key}.args.block_size={block_size} is longer than the model's {positions} positions; lower "
            f"{key}.args.block_size or raise the model's (model.args.block_size or max_position_embeddings)"
        )
    vocab_size = model_vocab_size(model)
    if args.get("tokenizer") is None or vocab_size is None:
        return
    from paratrain.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args["tokenizer"], eos_token=args.get("eos_token"), key=f"{key}.args.tokenizer")
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"{key}.args.tokenizer={args['tokenizer']!r} has {tokenizer.vocab_size} tokens but the model embeds "
            f"{vocab_size} (model.args.vocab_size); set model.args.vocab_size to at least {tokenizer.vocab_size}"
        )
