"""Chat samples packed into rows of ``seq_len`` tokens, each sample computed as if it were alone.

Packing (``best_fit``) is best-fit decreasing: samples are taken longest first, each into the fullest row it
still fits, a new row when none has room. It is chosen over greedy first-fit in the data's order because
chat data is uneven (a few long conversations among many short ones): the long ones placed first leave
gaps that the short ones fill, and the rows come out nearly full (the log gives the fill). The packing is
done once, when the dataset is built, so it is the same on every rank and in every epoch; the sampler then
shuffles and shards the rows, so each sample is read once per epoch at any data-parallel size, and a
resume continues at the same row.

Within a row, each sample keeps its own inputs and targets (its tokens shifted by one, as unpacked: no
target crosses into the next sample), its first input is marked (``parallel.documents.START_MARK``), and
the layout keeps attention inside each sample and restarts positions at 0 in each
(``parallel.documents``). Padding at the end of a row is a document of its own, with no targets. So a
sample's logits, loss terms and gradients are those it has unpacked, and the token-mean loss over a step's
target tokens is the same.
"""

from __future__ import annotations

import logging
import os

import torch
from torch.utils.data import Dataset

from paratrain.losses import IGNORE_INDEX
from paratrain.parallel.documents import mark_starts

logger = logging.getLogger(__name__)


def best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows of sample indices whose lengths sum to at most ``capacity`` each, by best-fit decreasing (see the
    module docstring); rows in the order they were opened, each row's samples in the order placed.

    Rows are found by their free space: a row with ``free`` tokens left sits in ``rows_by_free[free]``, and
    bit ``free`` of ``nonempty`` says that list has one, so the fullest row with room for a sample is the
    lowest set bit at or above its length.
    """
    rows: list[list[int]] = []
    rows_by_free: dict[int, list[int]] = {}
    nonempty = 0
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        above = nonempty >> length
        if above:
            free = length + (above & -above).bit_length() - 1
            row = rows_by_free[free].pop()
            if not rows_by_free[free]:
                nonempty &= ~(1 << free)
        else:
            free, row = capacity, len(rows)
            rows.append([])
        rows[row].append(index)
        left = free - length
        rows_by_free.setdefault(left, []).append(row)
        nonempty |= 1 << left
    return rows


class PackedSamples(Dataset):
    """Samples (``tokens`` with ``labels``, as ``data.chat.ChatSample``) packed into ``seq_len``-token rows.

    Each item is (inputs, targets): every sample's ``tokens[:-1]`` and ``labels[1:]`` one after another, the
    first input of each marked as a sample's start, then padding (``pad_id`` inputs, no targets).
    """

    marks_sample_starts = True  # what parallel.documents.boundaries_of reads

    def __init__(self, samples: list, *, seq_len: int, pad_id: int, vocab_size: int):
        self.samples, self.seq_len, self.pad_id, self.vocab_size = samples, seq_len, pad_id, vocab_size
        self.rows = best_fit([len(sample.tokens) - 1 for sample in samples], seq_len)
        if int(os.environ.get("RANK", 0)) == 0:
            used = sum(len(sample.tokens) - 1 for sample in samples)
            logger.info(
                "packed %d samples into %d rows of %d tokens: %.1f %% of the tokens are samples, the rest padding",
                len(samples),
                len(self.rows),
                seq_len,
                100 * used / (len(self.rows) * seq_len),
            )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        targets = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        starts, at = [], 0
        for sample in (self.samples[i] for i in self.rows[index]):
            length = len(sample.tokens) - 1  # the last token is only ever a target
            inputs[at : at + length] = torch.tensor(sample.tokens[:-1])
            targets[at : at + length] = torch.tensor(sample.labels[1:])
            starts.append(at)
            at += length
        if at < self.seq_len:
            starts.append(at)  # the padding: a document of its own that no sample attends to
        return mark_starts(inputs, starts), targets
