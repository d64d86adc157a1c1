"""parallel.activation_checkpointing on one block, counted as torch runs it: what backward recomputes under
full and selective checkpointing, and which blocks activation_checkpointing_every wraps. (That each trains
as one process does is tests/parity/test_sharded_matches_single.py.)"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from paratrain.models.gpt import build_gpt
from paratrain.parallel.activation import apply_activation_checkpointing

MATMUL = torch.ops.aten.addmm.default  # a Linear with a bias, on the 2-d view of its input


class CountOperators(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def backward_operators(mode: str | None, *, every: int = 1) -> Counter:
    """The operators backward runs for one forward of a 2-block GPT checkpointed as ``mode`` (None: not)."""
    torch.manual_seed(0)
    model = build_gpt(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    if mode is not None:
        apply_activation_checkpointing(model, plan=model.parallel_plan(), mode=mode, every=every)
    loss = model(torch.randint(0, 64, (2, 16))).float().pow(2).mean()
    with CountOperators() as counted:
        loss.backward()
    return counted.counts


def test_selective_checkpointing_recomputes_no_matmul_and_full_recomputes_every_one():
    plain, full, selective = backward_operators(None), backward_operators("full"), backward_operators("selective")
    # Full runs each block's forward again, up to the last tensor backward reads (torch stops the recompute
    # there, before down_proj): 5 of its 6 projections, and the attention.
    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert (full[MATMUL] - plain[MATMUL], full[attention]) == (2 * 5, 2)
    assert (selective[MATMUL], selective[attention]) == (plain[MATMUL], 0)  # saved by the policy, read back
    # ... while the cheap operators between them are recomputed under both.
    gelu = torch.ops.aten.gelu.default
    assert plain[gelu] == 0 and selective[gelu] == full[gelu] == 2


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_every_2nd_block_is_checkpointed_and_the_others_keep_their_activations(mode):
    torch.manual_seed(0)
    model = build_gpt(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)
    apply_activation_checkpointing(model, plan=model.parallel_plan(), mode=mode, every=2)
    wrapped = [hasattr(block, "_checkpoint_wrapped_module") for block in model.blocks]
    assert wrapped == [False, True, False, True]
    assert backward_operators(mode, every=2)[torch.ops.aten.gelu.default] == 1  # block 1 of 2 recomputes
