"""The pieces of context parallel and document masking that need no process group: which tokens each cp
rank holds, documents and their positions in a packed window, and the attention mask (issue 23)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paratrain.errors import ConfigError
from paratrain.parallel.sequence_sharding import SequenceSharding, attention_mask, document_layout, local_token_indices


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
    documents, positions = document_layout(tokens, end_id=0)
    assert documents.tolist() == [[0, 0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 1]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 0], [0, 0, 1, 2, 3, 4, 5]]


def test_the_mask_is_causal_within_documents_and_the_sliding_window():
    documents = torch.tensor([[0, 0, 1, 1]])
    mask = attention_mask(4, documents=documents, sliding_window=None, device=torch.device("cpu"))
    assert mask[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    window = attention_mask(4, documents=None, sliding_window=2, device=torch.device("cpu"))
    assert window[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    assert attention_mask(4, documents=None, sliding_window=None, device=torch.device("cpu")) is None


def test_document_masked_attention_equals_attending_to_each_document_alone():
    torch.manual_seed(0)
    tokens = torch.tensor([[3, 4, 9, 5, 6, 7]])  # two documents: [3, 4, 9] and [5, 6, 7]
    sharding = SequenceSharding(cp=1, cp_rank=0, cp_group=None, document_end_id=9)
    inputs, _ = sharding.shard(tokens, tokens)
    assert sharding.positions(inputs).tolist() == [[0, 1, 2, 0, 1, 2]]
    query, key, value = (torch.randn(1, 2, 6, 4) for _ in range(3))
    together = sharding.attention(query, key, value)
    for part in (slice(0, 3), slice(3, 6)):
        alone = F.scaled_dot_product_attention(query[:, :, part], key[:, :, part], value[:, :, part], is_causal=True)
        torch.testing.assert_close(together[:, :, part], alone)
    sharding.release()
    assert sharding.positions(inputs).tolist() == [[0, 1, 2, 3, 4, 5]]  # nothing cut: counted from 0
