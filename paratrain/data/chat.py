"""Chat and instruction samples: conversations rendered by the tokenizer's chat template, with the loss on
the assistant's replies only.

Every conversation is tokenized once, into a cache shared by every rank of a node and every later run
(paratrain.data.shared_cache: keyed by the files, the tokenizer and the template). Labels: each token of an assistant reply, with the end-of-turn tokens the template puts after it,
is a target; every other token (system prompt, user turns, the template's role headers) carries
``IGNORE_INDEX``. A multi-turn conversation is one sample that learns every assistant reply in it, each
seeing the whole conversation before it.

Which tokens are the reply: a template with ``{% generation %}`` markers tells transformers directly
(``return_assistant_tokens_mask``); for any other template the conversation is rendered turn by turn, and
reply ``i`` is the tokens between the rendering of the turns before it (with the generation prompt) and the
rendering that ends with it. A template whose renderings are not prefixes of each other is refused.

Samples are packed into rows of ``seq_len`` tokens (``pack``, the default; paratrain.data.packing), each computed
as if it were alone: positions restart at 0 in every sample and no token attends to another sample. With
``pack=False`` each sample is padded to ``seq_len`` on its own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from paratrain.data.conversations import Conversation, iter_conversations
from paratrain.data.corpus import resolve_files
from paratrain.data.packing import PackedSamples
from paratrain.data.shared_cache import DEFAULT_CACHE_DIR, cache_key, directory_digest, fingerprint, shared_cache
from paratrain.errors import ConfigError
from paratrain.losses import IGNORE_INDEX

logger = logging.getLogger(__name__)

CHAT_CACHE_FORMAT = 1
SAMPLE_ARRAYS = ("tokens", "labels", "offsets")  # every sample's ids and labels, one after another; where each begins


@dataclass(frozen=True)
class ChatSample:
    """One conversation's tokens and labels (IGNORE_INDEX where no loss is taken), of equal length."""

    tokens: list[int]
    labels: list[int]


class ChatSamples(Dataset):
    """Tokenized conversations as (inputs, targets) pairs of ``seq_len`` tokens each, padded at the end."""

    def __init__(self, samples: list[ChatSample], *, seq_len: int, pad_id: int, vocab_size: int):
        self.samples, self.seq_len, self.pad_id = samples, seq_len, pad_id
        self.vocab_size = vocab_size  # what the shape check before training compares with the model's embedding

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        sample = self.samples[index]
        inputs = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        targets = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        length = len(sample.tokens) - 1  # the last token is only ever a target
        inputs[:length] = torch.tensor(sample.tokens[:-1])
        targets[:length] = torch.tensor(sample.labels[1:])
        return inputs, targets


def chat_data(
    *,
    files: str | list[str],
    tokenizer: str,
    seq_len: int,
    overflow: Literal["truncate", "drop"] = "truncate",
    chat_template: str | None = None,
    pack: bool = True,
    cache_dir: str = DEFAULT_CACHE_DIR,
) -> ChatSamples | PackedSamples:
    """Factory for config files: ``data.factory: paratrain.data.chat:chat_data``.

    Args:
        files: ``.jsonl`` or ``.parquet`` files, or directories written by ``datasets``' ``save_to_disk``, whose
            rows hold ``messages`` or ``prompt``/``completion`` (see paratrain.data.conversations).
        tokenizer: A directory a transformers tokenizer was saved to (``save_pretrained``).
        seq_len: Tokens per sample's inputs; at most the model's positions.
        overflow: A conversation longer than ``seq_len + 1`` tokens is cut to it (``truncate``) or left out
            (``drop``); the log counts both, and a sample left with no reply token is dropped either way.
        chat_template: A Jinja chat template to use instead of the tokenizer's own (or for one without).
        pack: Pack conversations into rows of ``seq_len`` tokens, each computed as if alone (paratrain.data.packing);
            False: one conversation per row, padded to ``seq_len``.
        cache_dir: Where tokenized conversations are kept, one directory per files/tokenizer/template.

    Raises:
        ConfigError: no files, a tokenizer without a chat template, bad rows, or no sample left.
    """
    if seq_len < 1 or overflow not in ("truncate", "drop"):
        raise ConfigError(
            f"data.args: seq_len={seq_len} must be at least 1 and overflow={overflow!r} 'truncate' or 'drop'"
        )
    loaded = load_chat_tokenizer(tokenizer, chat_template=chat_template)
    rendered_all = tokenized_once(
        resolve_files(files),
        lambda paths: [render(loaded, conversation) for path in paths for conversation in iter_conversations(path)],
        key={"tokenizer": directory_digest(Path(tokenizer)), "template": loaded.chat_template, "kind": "chat"},
        cache_dir=Path(cache_dir),
    )
    samples, cut, dropped = [], 0, 0
    for rendered in rendered_all:
        sample = fit(rendered, seq_len=seq_len, overflow=overflow)
        cut += sample is not None and len(sample.tokens) < len(rendered.tokens)
        dropped += sample is None
        samples += [sample] if sample is not None else []
    if not samples:
        raise ConfigError(f"data.args: no conversation in {files!r} keeps a reply within seq_len={seq_len}")
    if int(os.environ.get("RANK", 0)) == 0:
        logger.info(
            "chat data: %d samples, %d truncated and %d dropped at seq_len=%d", len(samples), cut, dropped, seq_len
        )
    pad_id = loaded.pad_token_id if loaded.pad_token_id is not None else (loaded.eos_token_id or 0)
    rows = PackedSamples if pack else ChatSamples
    return rows(samples, seq_len=seq_len, pad_id=pad_id, vocab_size=len(loaded))


def tokenized_once(
    files: list[Path], tokenize: Callable[[list[Path]], list[ChatSample]], *, key: dict, cache_dir: Path
) -> list[ChatSample]:
    """``tokenize(files)``'s samples, from the shared cache when an intact one exists for these files and ``key``
    (the tokenizer and template), else tokenized by local rank 0 into it while the node's other ranks wait."""
    inputs = {"format": CHAT_CACHE_FORMAT, "files": [fingerprint(path) for path in files], **key}
    directory = Path(cache_dir).expanduser() / cache_key(inputs)
    shared_cache(directory, lambda staging: _write_samples(staging, tokenize(files)), local_rank=_local_rank())
    tokens, labels, offsets = (np.load(directory / f"{name}.npy", allow_pickle=False) for name in SAMPLE_ARRAYS)
    return [
        ChatSample(tokens[start:end].tolist(), labels[start:end].tolist())
        for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)
    ]


def _write_samples(staging: Path, samples: list[ChatSample]) -> dict:
    logger.info("tokenized %d samples into the data cache %s", len(samples), staging.with_suffix(""))
    lengths = [len(sample.tokens) for sample in samples]
    arrays = {
        "tokens": np.array([token for sample in samples for token in sample.tokens], dtype=np.int64),
        "labels": np.array([label for sample in samples for label in sample.labels], dtype=np.int64),
        "offsets": np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
    }
    for name, array in arrays.items():
        np.save(staging / f"{name}.npy", array, allow_pickle=False)
    return {"samples": len(samples), "tokens": int(sum(lengths))}


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def load_chat_tokenizer(path: str, *, chat_template: str | None):
    """A transformers tokenizer with a chat template.

    Raises:
        ConfigError: the path holds no tokenizer, or the tokenizer has no chat template and none is given.
    """
    # Lazy: transformers takes seconds to import and is only needed for chat data.
    from transformers import AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(os.path.expanduser(path))
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"data.args.tokenizer={path!r} is not a transformers tokenizer directory ({error}); give the directory "
            f"a tokenizer was saved to with save_pretrained"
        ) from None
    if chat_template is not None:
        loaded.chat_template = chat_template
    if not loaded.chat_template:
        raise ConfigError(
            f"data.args.tokenizer={path!r} has no chat template; use the tokenizer of the model's instruct version, "
            f"or give one as data.args.chat_template (a Jinja string)"
        )
    return loaded


def render(tokenizer, conversation: Conversation) -> ChatSample:
    """The conversation's tokens, and labels that keep the assistant's replies only (see the module docstring)."""
    if "{% generation %}" in tokenizer.chat_template or "{%- generation %}" in tokenizer.chat_template:
        encoded = tokenizer.apply_chat_template(
            conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        tokens, mask = list(encoded["input_ids"]), encoded["assistant_masks"]
        return ChatSample(tokens, [token if keep else IGNORE_INDEX for token, keep in zip(tokens, mask, strict=True)])
    tokens = _tokens(tokenizer, conversation, add_generation_prompt=False)
    labels = [IGNORE_INDEX] * len(tokens)
    for index, turn in enumerate(conversation):
        if turn["role"] != "assistant":
            continue
        start = len(_prefix(tokenizer, conversation[:index], tokens, add_generation_prompt=True))
        end = len(_prefix(tokenizer, conversation[: index + 1], tokens, add_generation_prompt=False))
        labels[start:end] = tokens[start:end]
    return ChatSample(tokens, labels)


def fit(sample: ChatSample, *, seq_len: int, overflow: str) -> ChatSample | None:
    """The sample cut to ``seq_len + 1`` tokens (None: dropped, or left without a target)."""
    if len(sample.tokens) > seq_len + 1:
        if overflow == "drop":
            return None
        sample = ChatSample(sample.tokens[: seq_len + 1], sample.labels[: seq_len + 1])
    has_target = any(label != IGNORE_INDEX for label in sample.labels[1:])
    return sample if has_target else None


def _tokens(tokenizer, conversation: Conversation, *, add_generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"] if conversation else []


def _prefix(tokenizer, turns: Conversation, whole: list[int], *, add_generation_prompt: bool) -> list[int]:
    prefix = _tokens(tokenizer, turns, add_generation_prompt=add_generation_prompt)
    if whole[: len(prefix)] != prefix:
        raise ConfigError(
            "data.args.chat_template: rendering the first turns of a conversation does not begin its full "
            "rendering, so the assistant's replies cannot be found; use a template with {% generation %} "
            "markers, or one that renders each turn after the previous ones"
        )
    return prefix
