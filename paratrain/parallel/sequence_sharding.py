"""Context parallel and document masking: which tokens of each sample a rank computes, their positions,
and the attention that sees each whole sequence again.

Context parallel (``parallel.cp``) splits every sample's sequence over the cp ranks of a data-parallel
rank, load-balanced for causal attention as torch's and Megatron's are: the sequence is cut into
2·cp chunks and rank r holds chunks r and 2·cp−1−r, so each rank has as many early tokens (little to
attend to) as late ones. Embeddings, norms, MLPs and the loss run on the rank's tokens alone; only
attention needs the others', through the all-to-all exchange of DeepSpeed Ulysses: each rank trades
(all heads, its tokens) for (1/cp of the heads, all tokens), attends over whole sequences with any
kernel, and trades back. That needs cp to divide the (key/value) heads, and costs two all-to-alls of
the activations per attention, whatever the sequence length.

Documents (a corpus with ``data.args.document_mask``, or packed samples: parallel/documents.py) keep
attention within each document of a row and restart positions at each document, so a document is
computed as if it were a row of its own; attention runs on each document alone, with no mask built.

The model reads all of this through two functions a layout installs on it (models/attention_hooks.py):
``attention(q, k, v, ...)`` and ``positions(tokens)``. Both follow the micro-batch the engine last cut
(``SequenceSharding.shard``); with none cut (evaluation, the sample check, a warm-up), attention is
the plain causal attention of the rank's own tokens and positions count from 0.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce

from paratrain.errors import ConfigError
from paratrain.parallel.dims import ParallelDims
from paratrain.parallel.documents import DocumentBoundaries, ReadDocuments, document_attention, layout_from_starts


def build_sequence_sharding(dims: ParallelDims, *, documents: DocumentBoundaries | None) -> SequenceSharding | None:
    """This rank's cut of every sequence under ``dims`` (mesh built), or None when each rank computes whole
    sequences with plain causal attention (no cp, no documents): nothing is installed then."""
    if not dims.cp_enabled and documents is None:
        return None
    group = dims.cp_mesh.get_group() if dims.cp_enabled else None
    return SequenceSharding(cp=dims.cp, cp_rank=dims.cp_rank, cp_group=group, documents=documents)


def local_token_indices(seq_len: int, *, cp: int, cp_rank: int) -> torch.Tensor:
    """The token indices, in order, that cp rank ``cp_rank`` of ``cp`` holds of a ``seq_len``-token sequence:
    chunk ``cp_rank`` and chunk ``2·cp−1−cp_rank`` of 2·cp equal chunks (torch's head-tail balancing)."""
    if seq_len % (2 * cp):
        raise ConfigError(
            f"parallel.cp={cp}: a sequence of {seq_len} tokens does not split into 2 x cp = {2 * cp} equal "
            f"chunks (each rank holds an early and a late one); use a sequence length divisible by {2 * cp}"
        )
    chunk = seq_len // (2 * cp)
    first, second = cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


@dataclass
class CutMicroBatch:
    """What attention and positions need of the micro-batch the engine last cut.

    Attributes:
        positions: Each of this rank's tokens' position, ``(batch or 1, local tokens)``.
        documents: The document of every token of the whole sequence, ``(batch, seq)``; None: one
            causal sequence (attention within documents: parallel/documents.py).
        exchange: Whether attention gathers the other cp ranks' tokens (False: the rank holds whole
            sequences, as in evaluation).
        masks: The additive sliding-window masks built for this micro-batch, by (window, dtype): built once
            and shared by every layer, so autograd keeps one copy for backward, not one per layer.
    """

    positions: torch.Tensor
    documents: torch.Tensor | None
    exchange: bool
    masks: dict[tuple[int | None, torch.dtype], torch.Tensor | None] = field(default_factory=dict)

    @functools.cached_property
    def read(self) -> ReadDocuments:
        """The documents as every layer's attention reads them, read once (each read waits for the GPU)."""
        return ReadDocuments(self.documents)

    def mask(self, seq_len: int, *, sliding_window: int | None, like: torch.Tensor) -> torch.Tensor | None:
        """The additive mask (0 where allowed, -inf elsewhere) for queries of ``like``'s dtype and device."""
        key = (sliding_window, like.dtype)
        if key not in self.masks:
            allowed = attention_mask(seq_len, sliding_window=sliding_window, device=like.device)
            self.masks[key] = None if allowed is None else additive(allowed, like.dtype)
        return self.masks[key]


class SequenceSharding:
    """One rank's view of context parallel and document masking: cuts each micro-batch, then answers the
    model's attention and position calls for it.

    Args:
        cp: Context-parallel degree (1: each rank holds whole sequences).
        cp_rank: This rank's index among them.
        cp_group: Their process group (None when cp is 1).
        documents: How each row marks where its documents begin, when attention is to stay within them;
            None: attention spans the whole row.
    """

    def __init__(
        self, *, cp: int, cp_rank: int, cp_group: ProcessGroup | None, documents: DocumentBoundaries | None = None
    ):
        self.cp, self.cp_rank, self.cp_group = cp, cp_rank, cp_group
        self.documents = documents
        self.current: CutMicroBatch | None = None
        self._orders: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    # Cutting micro-batches ----------------------------------------------------------------------

    def shard(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens of ``inputs`` and ``targets`` (``(batch, seq)`` each), remembered for the
        forward and backward that follow."""
        local = self._order(inputs.shape[1], inputs.device)[0]
        inputs, documents, positions = self._documents_and_positions(inputs)
        self.current = CutMicroBatch(positions[:, local], documents, exchange=self.cp > 1)
        # Targets that are not one tensor (a preference pair's labels and reference) are whole-sequence values.
        return inputs[:, local], targets[:, local] if isinstance(targets, torch.Tensor) else targets

    def local_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of ``targets``, without remembering anything (to count them ahead of the step)."""
        return targets[:, self._order(targets.shape[1], targets.device)[0]]

    def whole(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs`` kept whole on this rank (evaluation): attention stays local, documents still apply."""
        inputs, documents, positions = self._documents_and_positions(inputs)
        self.current = CutMicroBatch(positions, documents, exchange=False)
        return inputs

    def release(self) -> None:
        """Forgets the last micro-batch (its masks and positions), once its backward is done."""
        self.current = None

    # What the model calls -----------------------------------------------------------------------

    def sum_over_sequence(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the cp ranks holding the rest of this micro-batch's sequences, or as it is
        when this rank holds them whole: statistics over whole sequences (a mixture of experts' load-balancing
        loss). Differentiable: each rank's part gets the gradient of the sum, from every rank's use of it."""
        if self.current is None or not self.current.exchange:
            return tensor
        return differentiable_all_reduce(tensor, group=self.cp_group)

    def positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """Positions of the tokens a model's forward was given: ``(batch or 1, tokens)``."""
        if self.current is None or self.current.positions.shape[1] != tokens.shape[1]:
            return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        return self.current.positions.to(tokens.device)

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        dropout_p: float = 0.0,
        scale: float | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Causal attention of ``(batch, heads, local tokens, head_dim)`` tensors (key and value may have
        fewer heads: grouped-query attention) over each whole sequence, within documents and the sliding
        window where those apply; returns the output for this rank's tokens, shaped like ``query``."""
        current = self.current
        exchange = current is not None and current.exchange
        if exchange:
            query, key, value = (self._heads_for_tokens(tensor) for tensor in (query, key, value))
        seq_len = query.shape[2]
        if current is not None and current.documents is not None and current.documents.shape[1] == seq_len:
            output = document_attention(
                query,
                key,
                value,
                current.read,
                sliding_window=sliding_window,
                dropout_p=dropout_p,
                scale=scale,
            )
            return self._tokens_for_heads(output) if exchange else output
        if current is not None:
            mask = current.mask(seq_len, sliding_window=sliding_window, like=query)
        else:
            allowed = attention_mask(seq_len, sliding_window=sliding_window, device=query.device)
            mask = None if allowed is None else additive(allowed, query.dtype)
        output = sdpa(query, key, value, mask=mask, dropout_p=dropout_p, scale=scale)
        return self._tokens_for_heads(output) if exchange else output

    # The all-to-all exchange --------------------------------------------------------------------

    def _heads_for_tokens(self, tensor: torch.Tensor) -> torch.Tensor:
        """(batch, heads, local tokens, d) -> (batch, heads / cp, all tokens in sequence order, d)."""
        batch, heads, local, dim = tensor.shape
        cp = self.cp
        if heads % cp:
            raise ConfigError(
                f"parallel.cp={cp} must divide the attention heads each rank holds ({heads}); set parallel.cp "
                f"to a divisor of {heads}"
            )
        # Rank j receives head group j: all_to_all_single splits and concatenates along dim 0.
        outgoing = tensor.reshape(batch, cp, heads // cp, local, dim).transpose(0, 1).contiguous()
        incoming = all_to_all_single_autograd(outgoing, None, None, self.cp_group)
        gathered = incoming.permute(1, 2, 0, 3, 4).reshape(batch, heads // cp, cp * local, dim)
        natural = self._order(cp * local, tensor.device)[2]
        return gathered.index_select(2, natural)

    def _tokens_for_heads(self, tensor: torch.Tensor) -> torch.Tensor:
        """The inverse: (batch, heads / cp, all tokens, d) -> (batch, heads, this rank's tokens, d)."""
        batch, group_heads, seq, dim = tensor.shape
        cp, local = self.cp, seq // self.cp
        by_rank = tensor.index_select(2, self._order(seq, tensor.device)[1])
        outgoing = by_rank.reshape(batch, group_heads, cp, local, dim).permute(2, 0, 1, 3, 4).contiguous()
        incoming = all_to_all_single_autograd(outgoing, None, None, self.cp_group)
        return incoming.transpose(0, 1).reshape(batch, cp * group_heads, local, dim)

    def _order(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(this rank's token indices; every rank's, concatenated in rank order; the permutation that puts
        that concatenation back in sequence order), cached per length."""
        key = (seq_len, device)
        if key not in self._orders:
            local = local_token_indices(seq_len, cp=self.cp, cp_rank=self.cp_rank)
            by_rank = torch.cat([local_token_indices(seq_len, cp=self.cp, cp_rank=r) for r in range(self.cp)])
            self._orders[key] = (local.to(device), by_rank.to(device), torch.argsort(by_rank).to(device))
        return self._orders[key]

    def _documents_and_positions(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(the ids the model sees, each token's document or None, each token's position)."""
        if self.documents is None:
            return inputs, None, torch.arange(inputs.shape[1], device=inputs.device).unsqueeze(0)
        tokens, starts = self.documents.split(inputs)
        return tokens, *layout_from_starts(starts)


def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """SDPA over whole sequences: causal (its fused kernels' fast path) when there is no mask, else the
    additive mask (documents, sliding window), which already holds causality."""
    grouped = key.shape[1] != query.shape[1]
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=mask is None, dropout_p=dropout_p, scale=scale, enable_gqa=grouped
    )


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as SDPA's additive one: 0 where allowed, -inf elsewhere (what SDPA converts a boolean
    mask to inside every call; built once here so it is not rebuilt and kept again by every layer)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def attention_mask(seq_len: int, *, sliding_window: int | None, device: torch.device) -> torch.Tensor | None:
    """``(1, 1, seq, seq)`` booleans, True where query i may attend key j: j ≤ i, within the window (i − j <
    window, transformers' convention); None when causal alone."""
    if not sliding_window:
        return None
    query_index = torch.arange(seq_len, device=device).unsqueeze(1)
    key_index = torch.arange(seq_len, device=device).unsqueeze(0)
    allowed = (key_index <= query_index) & (query_index - key_index < sliding_window)
    return allowed.unsqueeze(0).unsqueeze(1)
