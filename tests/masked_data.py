"""A character corpus whose targets are masked unevenly: each sample keeps a different number of target
tokens (none to all of them), as chat samples with prompts of different lengths do. Config files name it as
``data.factory: tests.masked_data:build_unevenly_masked_chars``."""

from __future__ import annotations

import torch

from paratrain.data.text import CharDataset, build_char_dataset
from paratrain.losses import IGNORE_INDEX


class UnevenlyMaskedChars(CharDataset):
    """CharDataset windows whose first ``masked(index)`` targets are left out of the loss."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = super().__getitem__(index)
        targets = targets.clone()
        targets[: (index * 7) % (self.block_size + 1)] = IGNORE_INDEX  # 0 to all: samples differ widely
        return inputs, targets


def build_unevenly_masked_chars(*, block_size: int = 16, max_chars: int = 40_000) -> UnevenlyMaskedChars:
    chars = build_char_dataset(block_size=block_size, max_chars=max_chars)
    return UnevenlyMaskedChars(chars.tokens, block_size)
