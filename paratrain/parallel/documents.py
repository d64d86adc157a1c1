"""Where the documents (or packed samples) of a sequence begin, and attention that stays inside each one.

A dataset says how to find the boundaries of its rows (``boundaries_of``):

- ``EndToken``: documents end with a token of their own (a tokenized corpus's EOS, ``data.args.document_mask``);
- ``MarkedStarts``: each packed sample's first input token carries ``START_MARK`` (a high bit no vocabulary
  reaches), set by the dataset and cleared here before the model sees the ids (packed chat samples, whose
  templates put end-of-turn tokens inside every conversation, so no token can end one).

Attention within documents (``document_attention``) runs causal SDPA on each document alone, documents of
one length stacked into one call: its work and memory are Σ len², not seq², with no mask built, so it
divides by context parallel like the rest of the activations. Positions restart at 0 in each document.

Those calls take every document length there is, new ones at every step, so they leave out cuDNN's attention:
torch puts it first on Hopper and Blackwell GPUs, and it builds an execution graph for each new shape (tens
of ms each). On a lent H100 that made attention within documents 120x plain causal attention's time, and
packed fine-tuning 0.06x padded's tokens/s; flash attention, next in torch's order, takes any length.

On a GPU with flash attention (bf16 or fp16, no dropout, torch >= 2.10), one variable-length flash call
(``varlen_attn``) takes every document of the micro-batch at once instead: no stacking per length, no
call per length. The per-length calls stayed 4.3x causal attention's time on an H100 even without cuDNN.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# Bit 62 of an int64 token id: far above any vocabulary, and the sign bit stays clear.
START_MARK = 1 << 62
# torch's own order without cuDNN's attention, whose per-shape graphs make ragged lengths slow (see above).
ANY_LENGTH_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# What flash attention's kernels take: half precision, head sizes a multiple of 8 up to 256, Ampere or newer.
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
FLASH_MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class EndToken:
    """Documents end with ``token`` (it belongs to the document it ends); the next token begins one."""

    token: int

    def split(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the ids, where each document starts) of ``(batch, seq)`` inputs."""
        ends = inputs == self.token
        return inputs, torch.cat([torch.ones_like(ends[:, :1]), ends[:, :-1]], dim=1)


@dataclass(frozen=True)
class MarkedStarts:
    """Each document's first token is marked with ``START_MARK`` (``mark_starts``)."""

    def split(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the ids without marks, where each document starts) of ``(batch, seq)`` inputs."""
        starts = (inputs & START_MARK) != 0
        starts[:, 0] = True
        return inputs & ~START_MARK, starts


DocumentBoundaries = EndToken | MarkedStarts


def boundaries_of(dataset: object) -> DocumentBoundaries | None:
    """How a dataset's rows mark their documents: its ``document_end_id`` (document masking of a corpus), or its
    ``marks_sample_starts`` (packed samples); None when attention spans each whole row."""
    end_id = getattr(dataset, "document_end_id", None)
    if isinstance(end_id, int):
        return EndToken(end_id)
    return MarkedStarts() if getattr(dataset, "marks_sample_starts", False) else None


def mark_starts(tokens: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """``tokens`` (one row) with ``START_MARK`` set at each index of ``starts``."""
    marked = tokens.clone()
    marked[starts] |= START_MARK
    return marked


def without_marks(inputs: torch.Tensor) -> torch.Tensor:
    """The ids of inputs that may carry start marks, as the model sees them (unchanged without marks)."""
    return inputs & ~START_MARK if not inputs.is_floating_point() else inputs


def layout_from_starts(starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which document each token belongs to, and its position within it, from ``(batch, seq)`` start flags:
    ``[T, F, F, T, F]`` -> documents ``[0, 0, 0, 1, 1]``, positions ``[0, 1, 2, 0, 1]``."""
    documents = torch.cumsum(starts.long(), dim=1) - 1
    index = torch.arange(starts.shape[1], device=starts.device).expand_as(starts)
    start_of_own = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    return documents, index - start_of_own


def document_spans(documents: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, first, end) of every document of ``(batch, seq)`` document ids, in order. One copy to the host,
    of the documents' starts: the loop runs over documents, not tokens (it runs once per micro-batch)."""
    batch, seq = documents.shape
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    flat = torch.nonzero(starts.reshape(-1)).reshape(-1).tolist()  # row * seq + first, in order
    spans = []
    for index, start in enumerate(flat):
        row, first = divmod(start, seq)
        following = flat[index + 1] if index + 1 < len(flat) else batch * seq
        spans.append((row, first, min(following - row * seq, seq)))  # the next start in this row, or its end
    return spans


class ReadDocuments:
    """A micro-batch's documents as attention reads them, read once for all its layers: their spans (a copy
    to the host, which waits for the GPU) and, for the variable-length call, their offsets on the device (a
    copy from the host, which waits for the GPU's stream)."""

    def __init__(self, documents: torch.Tensor):
        self.documents = documents

    @functools.cached_property
    def spans(self) -> list[tuple[int, int, int]]:
        return document_spans(self.documents)

    @functools.cached_property
    def starts(self) -> torch.Tensor:
        return starts_tensor(self.spans, self.documents.shape[1], device=self.documents.device)


def document_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    documents: torch.Tensor | ReadDocuments,
    *,
    sliding_window: int | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of ``(batch, heads, seq, head_dim)`` tensors within each document of ``documents``
    (``(batch, seq)``, or their ReadDocuments when the caller keeps it for every layer; key and value may have
    fewer heads): each document attends only to itself, exactly as if it were a sequence of its own. Returns a
    tensor shaped like ``query``."""
    read = documents if isinstance(documents, ReadDocuments) else ReadDocuments(documents)
    if takes_varlen(query, dropout_p):
        return _varlen_attention(query, key, value, read, sliding_window=sliding_window, scale=scale)
    by_length: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for span in read.spans:
        by_length[span[2] - span[1]].append(span)
    pieces: dict[tuple[int, int], torch.Tensor] = {}
    for length, same_length in by_length.items():
        q, k, v = (
            torch.stack([tensor[row, :, first:end] for row, first, end in same_length])
            for tensor in (query, key, value)
        )
        mask = _window(length, sliding_window, like=q)
        with sdpa_kernel(ANY_LENGTH_BACKENDS):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout_p, scale=scale,
                enable_gqa=k.shape[1] != q.shape[1],
            )  # fmt: skip
        for (row, first, _), piece in zip(same_length, out.unbind(0), strict=True):
            pieces[row, first] = piece
    rows = []
    for row in range(query.shape[0]):
        firsts = sorted(first for piece_row, first in pieces if piece_row == row)
        rows.append(torch.cat([pieces[row, first] for first in firsts], dim=1))
    return torch.stack(rows)


def takes_varlen(query: torch.Tensor, dropout_p: float) -> bool:
    """Whether one variable-length flash attention call can serve ``query``'s documents."""
    if not query.is_cuda or attention_dtype(query) not in FLASH_DTYPES or dropout_p:
        return False
    head_dim = query.shape[-1]
    if head_dim % 8 or head_dim > FLASH_MAX_HEAD_DIM:
        return False
    return _varlen_attn() is not None and torch.cuda.get_device_capability(query.device) >= FLASH_MIN_CAPABILITY


def attention_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype attention computes in: autocast's on a GPU under it (SDPA casts to it, and rotary embeddings
    hand attention float32 queries there), else the query's own."""
    if query.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return query.dtype


def cumulative_starts(spans: list[tuple[int, int, int]], seq: int) -> list[int]:
    """Where each document starts in the ``(batch * seq)`` flattened tokens, and their end: the offsets a
    variable-length attention call takes (``[0, len_0, len_0 + len_1, ..., batch * seq]``)."""
    return [row * seq + first for row, first, _ in spans] + [(spans[-1][0] + 1) * seq]


def starts_tensor(spans: list[tuple[int, int, int]], seq: int, *, device: torch.device) -> torch.Tensor:
    """``cumulative_starts`` as the int32 tensor on ``device`` that the variable-length call takes."""
    return torch.tensor(cumulative_starts(spans, seq), dtype=torch.int32, device=device)


def _varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    read: ReadDocuments,
    *,
    sliding_window: int | None,
    scale: float | None,
) -> torch.Tensor:
    """``document_attention`` as one flash attention call over every document of the micro-batch."""
    batch, heads, seq, head_dim = query.shape
    if key.shape[1] != heads:  # torch's call takes grouped-query heads only from 2.13 on
        key, value = (tensor.repeat_interleave(heads // key.shape[1], dim=1) for tensor in (key, value))
    dtype = attention_dtype(query)
    flat_q, flat_k, flat_v = (
        tensor.to(dtype).transpose(1, 2).reshape(batch * seq, heads, head_dim) for tensor in (query, key, value)
    )
    longest = max(end - first for _, first, end in read.spans)
    # (left, right) keys each query sees: causal, and within transformers' window (i - j < window).
    window = (sliding_window - 1, 0) if sliding_window else (-1, 0)
    starts = read.starts
    out = _varlen_attn()(flat_q, flat_k, flat_v, starts, starts, longest, longest, scale=scale, window_size=window)
    return out.reshape(batch, seq, heads, head_dim).transpose(1, 2)


def _varlen_attn():
    """torch's variable-length flash attention (torch >= 2.10), or None."""
    try:  # lazy: torch < 2.10 has no varlen module, and it is read only on a GPU with flash attention
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _window(length: int, sliding_window: int | None, *, like: torch.Tensor) -> torch.Tensor | None:
    """A causal sliding-window mask for one document (transformers' convention: i − j < window); None when
    the window does not cut into it (plain causal, SDPA's fused path)."""
    if not sliding_window or length <= sliding_window:
        return None
    query_index = torch.arange(length, device=like.device).unsqueeze(1)
    key_index = torch.arange(length, device=like.device).unsqueeze(0)
    allowed = (key_index <= query_index) & (query_index - key_index < sliding_window)
    return torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill(~allowed, float("-inf"))
