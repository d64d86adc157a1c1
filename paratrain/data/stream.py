"""Streaming: a corpus too large to tokenize ahead, tokenized as training reads it.

``data.factory: paratrain.data.lm:streamed_text`` takes the same files, tokenizer and packing as
``packed_text`` (documents followed by EOS, windows of ``block_size + 1`` tokens overlapping by one), but
reads them in order, encoding documents in batches as samples are needed; nothing is written to disk.

Every data-parallel rank reads the whole stream and keeps its share of each global batch (the r-th of dp
equal slices, like the map-style sampler). So the stream's position after a step (epoch, file, document and
token where the next window starts) is the same on every rank and does not depend on dp: the
checkpoint stores it, and a resume on the same or on another data-parallel size continues exactly where the
run stopped. The price is that each rank tokenizes every sample, not only its own: cheap beside a training
step (see docs/benchmarks.md, tokenization throughput), and the reason this path has no sample shuffling
(windows come in corpus order; shuffle the corpus' documents beforehand) and no loader workers (the
position would have to be gathered from the workers; ``data.num_workers`` must be 0).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import IterableDataset, default_collate

from paratrain.data.corpus import iter_documents
from paratrain.data.tokenizer import LoadedTokenizer
from paratrain.errors import ConfigError

if TYPE_CHECKING:
    from paratrain.config.schema import DataConfig

ENCODE_BATCH = 64


@dataclass
class StreamPosition:
    """Where the next window starts: token ``offset`` of document ``documents`` of file ``file_index``, in
    ``epoch``. A Stateful of plain integers, stored by the checkpoint under ``data``."""

    epoch: int = 0
    file_index: int = 0
    documents: int = 0
    offset: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "file_index": self.file_index, "documents": self.documents, "offset": self.offset}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.epoch, self.file_index = int(state_dict["epoch"]), int(state_dict["file_index"])
        self.documents, self.offset = int(state_dict["documents"]), int(state_dict["offset"])


class StreamedTokens(IterableDataset):
    """Windows of ``block_size + 1`` tokens read from the corpus in order, from ``self.position`` on.

    Iterating yields (inputs, targets) and moves ``position`` to the start of the next window before each
    yield, so between steps it is exactly where a resumed stream must start reading.
    """

    def __init__(
        self,
        files: list[Path],
        tokenizer: LoadedTokenizer,
        *,
        block_size: int,
        text_field: str,
        document_end_id: int | None = None,
    ):
        self.files, self.tokenizer, self.block_size, self.text_field = files, tokenizer, block_size, text_field
        self.document_end_id = document_end_id  # as PackedTokens': the EOS id under document masking, else None
        self.position = StreamPosition()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        position, window = self.position, self.block_size + 1
        carry: list[int] = []
        spans: deque[list[int]] = deque()  # [file, document, first token's offset, tokens] of what carry holds
        file_index, first_document, skip, yielded = position.file_index, position.documents, position.offset, False
        while True:
            for number, ids in enumerate(self._encoded(file_index, first_document), start=first_document):
                carry.extend(ids[skip:])
                spans.append([file_index, number, skip, len(ids) - skip])
                skip = 0
                while len(carry) >= window:
                    tokens = torch.tensor(carry[:window], dtype=torch.long)
                    carry = carry[self.block_size :]
                    _drop_front(spans, self.block_size)
                    position.file_index, position.documents, position.offset = spans[0][:3]
                    yielded = True
                    yield tokens[:-1], tokens[1:]
            file_index, first_document = file_index + 1, 0
            if file_index == len(self.files):  # the epoch's last partial window is dropped
                if not yielded:
                    raise ConfigError(
                        f"data.args: the corpus holds no window of block_size={self.block_size} + 1 tokens; use "
                        f"more text or a smaller block_size"
                    )
                file_index, carry, spans = 0, [], deque()
                position.epoch += 1

    def peek(self, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next ``count`` windows, leaving the position where it was."""
        saved = self.position.state_dict()
        windows = list(itertools.islice(iter(self), count))
        self.position.load_state_dict(saved)
        return windows

    def _encoded(self, file_index: int, skip: int) -> Iterator[list[int]]:
        """Token ids of each document of a file from document ``skip`` on, EOS appended, encoded in batches."""
        documents = itertools.islice(iter_documents(self.files[file_index], text_field=self.text_field), skip, None)
        while batch := list(itertools.islice(documents, ENCODE_BATCH)):
            for encoding in self.tokenizer.tokenizer.encode_batch(batch, add_special_tokens=False):
                yield [*encoding.ids, self.tokenizer.eos_id]


def _drop_front(spans: deque[list[int]], count: int) -> None:
    """Removes ``count`` tokens from the front of the spans."""
    while count:
        span = spans[0]
        if span[3] <= count:
            count -= span[3]
            spans.popleft()
        else:
            span[2], span[3], count = span[2] + count, span[3] - count, 0


class StreamBatches:
    """Each step: the next global batch of windows, this rank's slice of it, as micro-batches."""

    def __init__(
        self, stream: StreamedTokens, *, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int
    ):
        self.stream, self.windows = stream, iter(stream)
        self.per_rank = global_batch_size // dp_size
        self.global_batch_size, self.micro_batch_size, self.dp_rank = global_batch_size, micro_batch_size, dp_rank
        self.step: list = []  # the newest global batch read, every rank's slice of it

    def __iter__(self) -> StreamBatches:
        return self

    def __next__(self) -> list:
        # The whole global batch is read, so the position after it is the same on every rank.
        self.step = list(itertools.islice(self.windows, self.global_batch_size))
        return self.slice_batches(self.dp_rank)

    def slice_batches(self, dp_rank: int) -> list:
        """Reader ``dp_rank``'s micro-batches of the newest global batch read."""
        mine = self.step[dp_rank * self.per_rank : (dp_rank + 1) * self.per_rank]
        return [
            default_collate(mine[i : i + self.micro_batch_size]) for i in range(0, self.per_rank, self.micro_batch_size)
        ]


def check_streaming(data: DataConfig, *, pipeline_stages: int) -> None:
    """Refuses what the stream cannot do: loader workers and pipeline stages."""
    if data.num_workers:
        raise ConfigError(
            f"data.num_workers={data.num_workers}: a streamed corpus is read in the training process (every rank "
            f"reads the same stream position); set data.num_workers=0, or use paratrain.data.lm:packed_text"
        )
    if pipeline_stages > 1:
        raise ConfigError(
            "data.factory=paratrain.data.lm:streamed_text cannot feed pipeline stages yet; use "
            "paratrain.data.lm:packed_text with pipeline parallel"
        )
