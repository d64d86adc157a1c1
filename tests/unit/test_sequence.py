"""The pieces of context parallel and document masking that need no process group: which tokens each cp
rank holds, documents (ended by a token, or marked packed samples) and their positions in a row, attention
within each document, and the sliding-window mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paratrain.errors import ConfigError
from paratrain.parallel import documents as documents_module
from paratrain.parallel.documents import EndToken, MarkedStarts, document_attention, layout_from_starts, mark_starts
from paratrain.parallel.sequence_sharding import SequenceSharding, attention_mask, local_token_indices


def test_each_cp_rank_holds_an_early_and_a_late_chunk_and_together_they_hold_every_token_once():
    held = [local_token_indices(16, cp=4, cp_rank=rank).tolist() for rank in range(4)]
    assert held[0] == [0, 1, 14, 15] and held[3] == [6, 7, 8, 9]
    assert sorted(sum(held, [])) == list(range(16))
    # Causal work per rank: a token at position i attends to i + 1 keys; every rank does the same amount.
    assert len({sum(i + 1 for i in tokens) for tokens in held}) == 1


def test_a_sequence_that_does_not_split_into_two_chunks_per_rank_is_refused_naming_the_fix():
    with pytest.raises(ConfigError, match="parallel.cp=4: a sequence of 20 tokens .* divisible by 8"):
        local_token_indices(20, cp=4, cp_rank=0)


def test_documents_end_with_their_end_token_and_positions_restart_after_it():
    tokens = torch.tensor([[5, 6, 0, 7, 8, 0, 9], [0, 1, 2, 3, 4, 5, 6]])
    ids, starts = EndToken(0).split(tokens)
    documents, positions = layout_from_starts(starts)
    assert torch.equal(ids, tokens)
    assert documents.tolist() == [[0, 0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 1]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 0], [0, 0, 1, 2, 3, 4, 5]]


def test_the_sliding_window_mask_is_causal_within_the_window():
    window = attention_mask(4, sliding_window=2, device=torch.device("cpu"))
    assert window[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    assert attention_mask(4, sliding_window=None, device=torch.device("cpu")) is None


def test_marked_sample_starts_are_read_and_cleared_before_the_model_sees_the_ids():
    row = mark_starts(torch.tensor([11, 12, 13, 21, 22, 0, 0]), [0, 3, 5])  # two samples, then padding
    ids, starts = MarkedStarts().split(row.unsqueeze(0))
    assert ids.tolist() == [[11, 12, 13, 21, 22, 0, 0]]
    documents, positions = layout_from_starts(starts)
    assert documents.tolist() == [[0, 0, 0, 1, 1, 2, 2]] and positions.tolist() == [[0, 1, 2, 0, 1, 0, 1]]


@pytest.mark.parametrize("window", [None, 2])
def test_attention_within_documents_equals_each_document_alone_forward_and_backward(window):
    """Documents of several lengths in two rows (some lengths shared: stacked into one call), grouped-query
    heads, with and without a sliding window: each document's output and gradients are its own alone."""
    torch.manual_seed(0)
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 1, 1, 1, 1, 1, 2]])
    query = torch.randn(2, 4, 8, 8, requires_grad=True)
    key, value = (torch.randn(2, 2, 8, 8, requires_grad=True) for _ in range(2))
    together = document_attention(query, key, value, documents, sliding_window=window)
    together.sum().backward()
    grads = [tensor.grad.clone() for tensor in (query, key, value)]
    for row, spans in ((0, [(0, 3), (3, 5), (5, 8)]), (1, [(0, 2), (2, 7), (7, 8)])):
        for first, end in spans:
            q, k, v = (
                tensor.detach()[row : row + 1, :, first:end].clone().requires_grad_() for tensor in (query, key, value)
            )
            mask = attention_mask(end - first, sliding_window=window, device=torch.device("cpu"))
            alone = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
            alone.sum().backward()
            torch.testing.assert_close(together[row : row + 1, :, first:end], alone)
            for grad, piece in zip(grads, (q, k, v), strict=True):
                torch.testing.assert_close(grad[row : row + 1, :, first:end], piece.grad)


def spans_token_by_token(documents: torch.Tensor) -> list[tuple[int, int, int]]:
    """The plain reading of document_spans: walk every token, cut where the document id changes."""
    spans = []
    for row, ids in enumerate(documents.tolist()):
        first = 0
        for index in range(1, len(ids) + 1):
            if index == len(ids) or ids[index] != ids[first]:
                spans.append((row, first, index))
                first = index
    return spans


@pytest.mark.parametrize(
    "rows",
    [
        [[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 1, 1, 1, 1, 1, 2]],
        [[0] * 8, [0, 1, 2, 3, 4, 5, 6, 7]],  # one document; every token its own
        [[0, 0, 0, 0, 0, 0, 0, 1]],  # a last document of one token
    ],
)
def test_document_spans_are_read_at_once_as_token_by_token(rows):
    documents = torch.tensor(rows)
    assert documents_module.document_spans(documents) == spans_token_by_token(documents)


def test_a_micro_batchs_document_spans_are_read_once_for_every_layer(monkeypatch):
    calls = []
    spans = documents_module.document_spans
    monkeypatch.setattr(documents_module, "document_spans", lambda documents: calls.append(1) or spans(documents))
    sharding = SequenceSharding(cp=1, cp_rank=0, cp_group=None, documents=EndToken(9))
    inputs = torch.tensor([[1, 2, 9, 3, 4, 5, 9, 6]])
    sharding.shard(inputs, inputs)
    query = torch.randn(1, 2, 8, 4)
    outputs = [sharding.attention(query, query, query) for _ in range(3)]  # three layers
    assert len(calls) == 1 and all(torch.equal(output, outputs[0]) for output in outputs)
    sharding.release()
    sharding.shard(inputs, inputs)  # the next micro-batch reads its own
    sharding.attention(query, query, query)
    assert len(calls) == 2


def test_the_variable_length_call_takes_each_documents_start_in_the_flattened_tokens():
    spans = documents_module.document_spans(torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 1, 1, 1, 1, 1, 2]]))
    assert documents_module.cumulative_starts(spans, seq=8) == [0, 3, 5, 8, 10, 15, 16]
    starts = documents_module.starts_tensor(spans, 8, device=torch.device("cpu"))
    assert starts.dtype == torch.int32 and starts.tolist() == [0, 3, 5, 8, 10, 15, 16]


def test_the_variable_length_call_is_for_half_precision_on_a_gpu_only():
    """On CPU, in float32 or with dropout, documents go through per-length SDPA calls (the CPU suite's path)."""
    query = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    assert not documents_module.takes_varlen(query, dropout_p=0.0)
    assert not documents_module.takes_varlen(query.float(), dropout_p=0.0)


def varlen_by_sdpa(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """torch's varlen_attn's contract ((tokens, heads, dim), offsets, (left, right) window), one SDPA per
    sequence: a CPU stand-in for the flash kernel, to check what document attention hands it."""
    left, right = window_size
    assert right == 0 and max_q == max_k and torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32
    out = torch.empty_like(query)
    for first, end in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist(), strict=True):
        index = torch.arange(end - first)
        allowed = (index[None, :] <= index[:, None]) & ((left < 0) | (index[:, None] - index[None, :] <= left))
        q, k, v = (tensor[first:end].transpose(0, 1) for tensor in (query, key, value))
        out[first:end] = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale).transpose(0, 1)
    return out


@pytest.mark.parametrize("window", [None, 2])
def test_the_variable_length_call_gets_every_document_with_its_offsets_heads_and_window(monkeypatch, window):
    """What document attention hands flash's varlen call (here a CPU stand-in keeping its contract) gives
    the per-length SDPA calls' output: the flattening, the offsets, grouped-query heads and the window."""
    torch.manual_seed(0)
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 1, 1, 1, 1, 1, 2]])
    query, key, value = (torch.randn(2, heads, 8, 8) for heads in (4, 2, 2))
    per_length = document_attention(query, key, value, documents, sliding_window=window)
    monkeypatch.setattr(documents_module, "takes_varlen", lambda query, dropout_p: True)
    monkeypatch.setattr(documents_module, "_varlen_attn", lambda: varlen_by_sdpa)
    varlen = document_attention(query, key, value, documents, sliding_window=window)
    torch.testing.assert_close(varlen, per_length)


def test_attention_within_documents_leaves_out_cudnns_attention(monkeypatch):
    """Each document length is its own SDPA call, and cuDNN's attention (torch's first choice on Hopper) builds a
    graph per new shape: on an H100 that made these calls 120x causal attention's time. The calls run with
    cuDNN's attention off, and torch's setting is back as it was after them."""
    seen, sdpa = [], F.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(documents_module.F, "scaled_dot_product_attention", recording_sdpa)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    query = key = value = torch.randn(1, 2, 6, 8)
    document_attention(query, key, value, torch.tensor([[0, 0, 1, 1, 1, 2]]))  # lengths 2, 3, 1: three calls
    assert seen == [False, False, False] and torch.backends.cuda.cudnn_sdp_enabled() == before


def test_document_masked_attention_equals_attending_to_each_document_alone():
    torch.manual_seed(0)
    tokens = torch.tensor([[3, 4, 9, 5, 6, 7]])  # two documents: [3, 4, 9] and [5, 6, 7]
    sharding = SequenceSharding(cp=1, cp_rank=0, cp_group=None, documents=EndToken(9))
    inputs, _ = sharding.shard(tokens, tokens)
    assert sharding.positions(inputs).tolist() == [[0, 1, 2, 0, 1, 2]]
    query, key, value = (torch.randn(1, 2, 6, 4) for _ in range(3))
    together = sharding.attention(query, key, value)
    for part in (slice(0, 3), slice(3, 6)):
        alone = F.scaled_dot_product_attention(query[:, :, part], key[:, :, part], value[:, :, part], is_causal=True)
        torch.testing.assert_close(together[:, :, part], alone)
    sharding.release()
    assert sharding.positions(inputs).tolist() == [[0, 1, 2, 3, 4, 5]]  # nothing cut: counted from 0
