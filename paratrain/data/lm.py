"""Packed language-modelling samples from a tokenized corpus.

The corpus' documents, each followed by EOS, form one token stream (paratrain.data.token_cache). Sample i
is the window ``stream[i*block_size : i*block_size + block_size + 1]``: its first ``block_size`` tokens are
the inputs and the last ``block_size`` the targets, so every token of the stream is a target once (the last
partial window is dropped). A window may span documents: by default attention is causal over the whole
window, so a document's tokens attend to the end of the previous one across the EOS (as nanoGPT and
GPT-2 trained). With ``document_mask=True`` the dataset's ``document_end_id`` is the EOS id, and the layout
keeps attention within each document and restarts positions at each (paratrain.parallel.sequence_sharding).

Samples are map-style: the global-batch sampler decides the order, which keeps every sample of an epoch
read exactly once on any data-parallel size, also across a resume on another size.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from paratrain.data.corpus import resolve_files
from paratrain.data.shared_cache import DEFAULT_CACHE_DIR
from paratrain.data.stream import StreamedTokens
from paratrain.data.token_cache import TokenArray, build_token_array
from paratrain.data.tokenizer import load_tokenizer
from paratrain.errors import ConfigError


class PackedTokens(Dataset):
    """Windows of block_size + 1 tokens over a memory-mapped token array, as (inputs, targets).

    Args:
        tokens: The token array on disk.
        block_size: Tokens per sample's inputs.
        first_sample: Index of this dataset's first window in the array (a validation split starts later).
        num_samples: Windows in this dataset.
        document_end_id: The EOS id when attention is to stay within each document (document masking).
    """

    def __init__(
        self,
        tokens: TokenArray,
        *,
        block_size: int,
        first_sample: int = 0,
        num_samples: int | None = None,
        document_end_id: int | None = None,
    ):
        self.tokens, self.block_size, self.first_sample = tokens, block_size, first_sample
        self.document_end_id = document_end_id  # attention stays within documents ending with it; None: whole window
        self.num_samples = windows_in(tokens.num_tokens, block_size) if num_samples is None else num_samples
        self._array: np.ndarray | None = None  # opened on first read, in the process that reads

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} of {self.num_samples}")
        start = (self.first_sample + index) * self.block_size
        window = torch.from_numpy(self.array[start : start + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.memmap(
                self.tokens.path, dtype=self.tokens.dtype, mode="r", shape=(self.tokens.num_tokens,)
            )
        return self._array

    def __getstate__(self) -> dict:
        # Loader workers re-open the map themselves instead of receiving a pickled copy of the array.
        return {**self.__dict__, "_array": None}


def windows_in(num_tokens: int, block_size: int) -> int:
    return max(num_tokens - 1, 0) // block_size


def packed_text(
    *,
    files: str | list[str],
    tokenizer: str,
    block_size: int,
    text_field: str = "text",
    eos_token: str | None = None,
    cache_dir: str = DEFAULT_CACHE_DIR,
    split: Literal["train", "validation"] = "train",
    validation_fraction: float = 0.0,
    document_mask: bool = False,
) -> PackedTokens:
    """Factory for config files: ``data.factory: paratrain.data.lm:packed_text``.

    Args:
        files: Corpus files, directories or globs: .txt (one document each), .jsonl and .parquet (one
            document per line or row), or directories written by ``datasets``' ``save_to_disk``.
        tokenizer: A ``tokenizer.json`` or a directory holding one (as saved by tokenizers or transformers).
        block_size: Tokens per sample; at most the model's positions.
        text_field: The JSON field or column holding the text.
        eos_token: The token put after each document; default: the tokenizer config's, or a common name.
        cache_dir: Where token arrays are kept, one directory per corpus/tokenizer/settings.
        split: ``train`` reads the first ``1 - validation_fraction`` of the samples, ``validation`` the rest
            (the same source through ``eval.factory``).
        validation_fraction: Share of the samples held out for validation.
        document_mask: Attention within each document of a window only, positions restarting at each
            (attention runs on each document alone: see docs/data.md for what it costs).

    Raises:
        ConfigError: missing files, an empty corpus, a JSON line without the text field, a path that is not a
            tokenizer, or a bad block size or split.
    """
    check_packing_args(block_size=block_size, split=split, validation_fraction=validation_fraction)
    loaded = load_tokenizer(tokenizer, eos_token=eos_token)
    tokens = build_token_array(
        resolve_files(files),
        loaded,
        text_field=text_field,
        cache_dir=Path(cache_dir),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
    )
    total = windows_in(tokens.num_tokens, block_size)
    held_out = int(total * validation_fraction)
    first, count = (0, total - held_out) if split == "train" else (total - held_out, held_out)
    if count == 0:
        raise ConfigError(
            f"data.args: the corpus' {tokens.num_tokens} tokens make no {split} sample of block_size={block_size} "
            f"tokens (validation_fraction={validation_fraction}); use more text or a smaller block_size"
        )
    end_id = loaded.eos_id if document_mask else None
    return PackedTokens(tokens, block_size=block_size, first_sample=first, num_samples=count, document_end_id=end_id)


def streamed_text(
    *,
    files: str | list[str],
    tokenizer: str,
    block_size: int,
    text_field: str = "text",
    eos_token: str | None = None,
    document_mask: bool = False,
) -> StreamedTokens:
    """Factory for config files: ``data.factory: paratrain.data.lm:streamed_text``: the corpus tokenized as
    training reads it, in order (paratrain.data.stream); needs ``data.num_workers=0``.

    Args: as for ``packed_text``.

    Raises:
        ConfigError: missing files, a path that is not a tokenizer, or a bad block size.
    """
    check_packing_args(block_size=block_size, split="train", validation_fraction=0.0)
    loaded = load_tokenizer(tokenizer, eos_token=eos_token)
    end_id = loaded.eos_id if document_mask else None
    return StreamedTokens(
        resolve_files(files), loaded, block_size=block_size, text_field=text_field, document_end_id=end_id
    )


def check_packing_args(*, block_size: int, split: str, validation_fraction: float) -> None:
    if block_size < 1:
        raise ConfigError(f"data.args.block_size={block_size} must be at least 1")
    if split not in ("train", "validation"):
        raise ConfigError(f"data.args.split={split!r} must be 'train' or 'validation'")
    if not 0 <= validation_fraction < 1 or (split == "validation" and validation_fraction == 0):
        raise ConfigError(
            f"data.args.validation_fraction={validation_fraction} must be in [0, 1), and above 0 for split='validation'"
        )
