"""Checks of the data against the model before training: a token id or position the model has no embedding
for, or targets the loss cannot compare with the model's output, fail here with the keys to change, not as
an IndexError or a shape error from the first step. The config's keys are checked before any process starts;
one sample of the built dataset through the model on the meta device before any parameter is allocated."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.parallel.documents import without_marks

# loss_fn(outputs, targets) -> mean loss, as paratrain.losses defines it (data/ imports no other package).
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


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
    # lazy: tokenizers (the data extra) load only for tokenizer-based data
    from paratrain.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args["tokenizer"], eos_token=args.get("eos_token"), key=f"{key}.args.tokenizer")
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"{key}.args.tokenizer={args['tokenizer']!r} has {tokenizer.vocab_size} tokens but the model embeds "
            f"{vocab_size} (model.args.vocab_size); set model.args.vocab_size to at least {tokenizer.vocab_size}"
        )


def check_dataset_fits_model(dataset: Any, model: nn.Module | None, loss_fn: LossFn, *, sources: SampleSources) -> None:
    """check_sample_fits_model on the dataset's first sample and the model built on the meta device (None: a
    model that does not build there, left to its real build, which reports its own errors)."""
    if model is None:
        return
    vocab = getattr(dataset, "vocab_size", None)
    check_sample_fits_model(
        dataset[0], model, loss_fn, sources=sources, dataset_vocab=vocab if isinstance(vocab, int) else None
    )


@dataclass(frozen=True)
class SampleSources:
    """How the user named the data, model and loss, for messages (``data.factory='...'``)."""

    data: str
    model: str
    loss: str


def check_sample_fits_model(
    sample: Any, model: nn.Module, loss_fn: LossFn, *, sources: SampleSources, dataset_vocab: int | None
) -> None:
    """One sample of the dataset against the model built on the meta device, before anything is allocated:
    its length against the model's positions, its token ids against the embedding, and the model's output
    against the targets through the loss (shapes only: meta tensors hold no values).

    Raises:
        ConfigError: naming the config keys to change.
    """
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
        return
    inputs, targets = sample
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        return
    inputs = without_marks(inputs)  # packed samples mark where each begins; the layout clears the marks
    if inputs.numel() == 0:
        raise ConfigError(
            f"{sources.data} gives an empty sample (inputs of shape {list(inputs.shape)}); check data.args "
            f"(e.g. a block_size of at least 1)"
        )
    if not inputs.is_floating_point() and inputs.dim() > 0:
        _check_sequence_length(inputs, model, sources)
        _check_token_ids(inputs, targets, model, sources, dataset_vocab=dataset_vocab)
    _check_output_against_targets(inputs, targets, model, loss_fn, sources)


def _check_sequence_length(inputs: torch.Tensor, model: nn.Module, sources: SampleSources) -> None:
    positions, length = model_positions(model), inputs.shape[-1]
    if positions is not None and length > positions:
        raise ConfigError(
            f"{sources.data} gives samples of {length} tokens but the model ({sources.model}) has {positions} "
            f"positions; lower data.args.block_size or raise the model's (model.args.block_size or "
            f"max_position_embeddings)"
        )


def _check_token_ids(
    inputs: torch.Tensor, targets: torch.Tensor, model: nn.Module, sources: SampleSources, *, dataset_vocab: int | None
) -> None:
    vocab_size = model_vocab_size(model)
    if vocab_size is None:
        return
    ids = [inputs.max().item()]
    if not targets.is_floating_point() and targets.numel():
        ids.append(targets.max().item())  # negative ids are the loss's ignore_index, never looked up
    needed = dataset_vocab if dataset_vocab is not None else max(ids) + 1
    if needed > vocab_size:
        raise ConfigError(
            f"{sources.data} has token ids up to {needed - 1} ({needed} tokens) but the model ({sources.model}) "
            f"embeds {vocab_size} (model.args.vocab_size); set model.args.vocab_size to at least {needed}"
        )


def _check_output_against_targets(
    inputs: torch.Tensor, targets: torch.Tensor, model: nn.Module, loss_fn: LossFn, sources: SampleSources
) -> None:
    batch, target = inputs.unsqueeze(0).to("meta"), targets.unsqueeze(0).to("meta")
    model.eval()  # the same shapes without dropout's random kernels, whose meta versions import torch._dynamo
    try:
        with torch.no_grad():
            outputs = model(batch)
    except Exception as error:  # noqa: BLE001 - on meta a failure may be the model's, not the data's
        if _meta_cannot_run(error):
            return
        raise ConfigError(
            f"one sample of {sources.data} (inputs of shape {list(inputs.shape)}) does not go through the model "
            f"({sources.model}): {type(error).__name__}: {_first_line(error)}; make the data's sample shape and "
            f"the model's input size agree (data.args, model.args)"
        ) from None
    try:
        with warnings.catch_warnings():
            # F.mse_loss only warns when it broadcasts targets of another shape: a silent wrong loss.
            warnings.simplefilter("error", UserWarning)
            loss_fn(outputs, target)
    except Exception as error:  # noqa: BLE001 - reported with the shapes; anything meta cannot run is skipped
        if _meta_cannot_run(error):
            return
        shape = (
            list(getattr(outputs, "logits", outputs).shape)
            if hasattr(outputs, "shape") or hasattr(outputs, "logits")
            else "?"
        )
        raise ConfigError(
            f"the model's output (shape {shape} for a batch of one) and the targets of {sources.data} (shape "
            f"{list(target.shape)}) do not fit {sources.loss}: {type(error).__name__}: {_first_line(error)}; make "
            f"the targets match the output (data.args, model.args) or choose another loss.factory"
        ) from None


def _meta_cannot_run(error: Exception) -> bool:
    """Errors of running on meta tensors (no values, missing meta kernels), not of the shapes."""
    # torch.autocast(device_type="meta") raises "unsupported scalarType": transformers 4.x rotary
    # embeddings enter autocast with their input's device type.
    return "meta" in str(error).lower() or "unsupported scalartype" in str(error).lower()


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else ""
