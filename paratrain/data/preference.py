"""Preference data for DPO: rows of a prompt, a chosen and a rejected completion, in TRL's column names, so a
dataset prepared for TRL's ``DPOTrainer`` loads as it is.

A row holds ``prompt``, ``chosen`` and ``rejected``: strings, or lists of chat turns (TRL's conversational
form: ``prompt`` the turns before the reply, ``chosen`` and ``rejected`` each the assistant's reply as a list
of one turn). Conversational rows are rendered by the tokenizer's chat template, strings are tokenized as
they are. As TRL does, the completion is what follows the prompt's own rendering (with the generation
prompt) in the rendering of prompt and completion; its tokens are the targets, the prompt's are not.

A pair is one sample: inputs ``(2 x seq_len,)``, the chosen sequence then the rejected one, each padded to
``seq_len`` and each computed as if alone (marked starts: parallel/documents.py); targets a dict of the
labels and the reference model's log-probabilities of the two completions (filled before training:
training/preference_reference.py). Every pair is tokenized once, into the shared data cache.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from paratrain.data.chat import ChatSample, load_chat_tokenizer, tokenized_once
from paratrain.data.conversations import rows_of
from paratrain.data.corpus import resolve_files
from paratrain.data.shared_cache import DEFAULT_CACHE_DIR, directory_digest
from paratrain.errors import ConfigError
from paratrain.losses import IGNORE_INDEX
from paratrain.parallel.documents import mark_starts

logger = logging.getLogger(__name__)

COLUMNS = ("prompt", "chosen", "rejected")


class PreferencePairs(Dataset):
    """Tokenized (chosen, rejected) pairs as (inputs, {labels, reference}) samples (see the module docstring).

    Attributes:
        reference: ``(pairs, 2)`` log-probabilities of the chosen and rejected completions under the
            reference model; NaN until they are computed (or loaded with a resumed checkpoint).
    """

    marks_sample_starts = True  # what parallel.documents.boundaries_of reads: two sequences per row
    is_preference_data = True  # what the DPO loss's checks read

    def __init__(self, pairs: list[tuple[ChatSample, ChatSample]], *, seq_len: int, pad_id: int, vocab_size: int):
        self.pairs, self.seq_len, self.pad_id, self.vocab_size = pairs, seq_len, pad_id, vocab_size
        self.reference = torch.full((len(pairs), 2), float("nan"))

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        inputs = torch.full((2 * self.seq_len,), self.pad_id, dtype=torch.long)
        labels = torch.full((2 * self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        starts = []
        for half, sample in enumerate(self.pairs[index]):
            at, length = half * self.seq_len, len(sample.tokens) - 1
            inputs[at : at + length] = torch.tensor(sample.tokens[:-1])
            labels[at : at + length] = torch.tensor(sample.labels[1:])
            starts += [at] + ([at + length] if length < self.seq_len else [])  # the sequence, then its padding
        return mark_starts(inputs, starts), {"labels": labels, "reference": self.reference[index].clone()}


def preference_data(
    *,
    files: str | list[str],
    tokenizer: str,
    seq_len: int,
    chat_template: str | None = None,
    cache_dir: str = DEFAULT_CACHE_DIR,
) -> PreferencePairs:
    """Factory for config files: ``data.factory: paratrain.data.preference:preference_data``.

    Args:
        files: ``.jsonl`` or ``.parquet`` files, or saved datasets, whose rows hold ``prompt``, ``chosen`` and
            ``rejected`` (strings or chat turns, as TRL's DPOTrainer reads them).
        tokenizer: A directory a transformers tokenizer was saved to (``save_pretrained``).
        seq_len: Tokens of each of a pair's two sequences (prompt and completion); the model sees ``2 x seq_len``.
        chat_template: A Jinja chat template to use instead of the tokenizer's own (conversational rows).
        cache_dir: Where tokenized pairs are kept, one directory per files/tokenizer/template.

    Raises:
        ConfigError: naming the file and row: a missing column, a chosen completion identical to the rejected
            one, or a prompt that leaves no room for its completion within ``seq_len``.
    """
    if seq_len < 2:
        raise ConfigError(f"data.args.seq_len={seq_len}: a prompt and a completion need at least 2 tokens")
    loaded = load_chat_tokenizer(tokenizer, chat_template=chat_template) if chat_template else _tokenizer(tokenizer)
    paths = resolve_files(files)
    samples = tokenized_once(
        paths,
        lambda paths: [sample for path in paths for pair in _pairs(path, loaded, seq_len) for sample in pair],
        key={"tokenizer": directory_digest(Path(tokenizer)), "template": loaded.chat_template, "kind": "preference"},
        cache_dir=Path(cache_dir),
    )
    pairs = [(samples[i], samples[i + 1]) for i in range(0, len(samples), 2)]
    if not pairs:
        raise ConfigError(f"data.args.files: {files!r} holds no preference rows")
    if int(os.environ.get("RANK", 0)) == 0:
        logger.info("preference data: %d pairs of at most %d tokens each", len(pairs), seq_len)
    pad_id = loaded.pad_token_id if loaded.pad_token_id is not None else (loaded.eos_token_id or 0)
    return PreferencePairs(pairs, seq_len=seq_len, pad_id=pad_id, vocab_size=len(loaded))


def _tokenizer(path: str):
    """The tokenizer, with its chat template if it has one (string rows need none)."""
    # Lazy: transformers takes seconds to import and is only needed for text data.
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.path.expanduser(path))
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"data.args.tokenizer={path!r} is not a transformers tokenizer directory ({error}); give the directory "
            f"a tokenizer was saved to with save_pretrained"
        ) from None


def _pairs(path: Path, tokenizer, seq_len: int):
    for number, row in enumerate(rows_of(path), start=1):
        where = f"{path} row {number}"
        prompt, chosen, rejected = _columns(row, where=where)
        yield tuple(_completion(tokenizer, prompt, reply, seq_len=seq_len, where=where) for reply in (chosen, rejected))


def _columns(row: dict[str, Any], *, where: str) -> tuple[Any, Any, Any]:
    missing = [column for column in COLUMNS if column not in row]
    if missing:
        raise ConfigError(
            f"data.args.files: {where} has no {' or '.join(repr(c) for c in missing)} column (it has: "
            f"{', '.join(sorted(row)) or 'none'}); preference rows hold prompt, chosen and rejected, as TRL's DPO reads"
        )
    if row["chosen"] == row["rejected"]:
        raise ConfigError(
            f"data.args.files: {where}: 'chosen' and 'rejected' are the same completion, which teaches no preference; "
            f"fix or remove the row"
        )
    return row["prompt"], row["chosen"], row["rejected"]


def _completion(tokenizer, prompt: Any, reply: Any, *, seq_len: int, where: str) -> ChatSample:
    """Prompt and reply tokenized as TRL's DPOTrainer does, the reply's tokens as targets, cut to ``seq_len + 1``.

    Raises:
        ConfigError: the prompt alone leaves no reply token within ``seq_len``.
    """
    conversational = isinstance(prompt, list)
    if conversational:
        prompt_ids = _chat(tokenizer, prompt, add_generation_prompt=True)
        whole = _chat(tokenizer, prompt + list(reply), add_generation_prompt=False)
    else:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        whole = tokenizer(prompt + reply, add_special_tokens=False)["input_ids"]
    start = next((i for i, (a, b) in enumerate(zip(prompt_ids, whole, strict=False)) if a != b), len(prompt_ids))
    if start >= seq_len:
        raise ConfigError(
            f"data.args.files: {where}: its prompt is {start} tokens, leaving no completion within "
            f"data.args.seq_len={seq_len}; raise seq_len or shorten the prompt"
        )
    tokens = whole[: seq_len + 1]
    labels = [IGNORE_INDEX] * start + tokens[start:]
    return ChatSample(tokens, labels)


def _chat(tokenizer, turns: list, *, add_generation_prompt: bool) -> list[int]:
    if not tokenizer.chat_template:
        raise ConfigError(
            "data.args.tokenizer has no chat template, and the rows are chat turns; give data.args.chat_template"
        )
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
