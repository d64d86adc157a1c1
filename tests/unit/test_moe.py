"""The GPT's mixture-of-experts feed-forward against numbers worked out by hand on four tokens: the
router's top-2 weights, the Switch load-balancing loss, the capacity's dropped assignments, the
training loss that adds the weighted loss, and the statistics the layer reports."""

from __future__ import annotations

import math

import pytest
import torch

from paratrain.losses import cross_entropy
from paratrain.models.gpt import build_gpt
from paratrain.models.moe import MoEConfig, MoEFeedForward

# With an identity router the logits are the tokens themselves; each is a permutation of (2, 1, 0).
TOKENS = torch.tensor([[2.0, 1.0, 0.0], [0.0, 2.0, 1.0], [2.0, 0.0, 1.0], [1.0, 0.0, 2.0]])
A, B, C = (math.exp(v) / (math.exp(2) + math.exp(1) + 1) for v in (2, 1, 0))  # softmax of (2, 1, 0)


def layer(capacity_factor: float | None = None) -> MoEFeedForward:
    moe = MoEFeedForward(3, 5, MoEConfig(num_experts=3, top_k=2, aux_loss_coef=0.1, capacity_factor=capacity_factor))
    with torch.no_grad():
        moe.router.gate.weight.copy_(torch.eye(3))
        moe.experts.up_proj.copy_(torch.linspace(-1, 1, 45).view(3, 3, 5))
        moe.experts.down_proj.copy_(torch.linspace(1, -0.5, 45).view(3, 5, 3))
    return moe


def test_router_keeps_the_top_two_experts_with_their_probabilities_renormalised():
    routing = layer().router(TOKENS)
    # token 0: experts 0 (logit 2) and 1 (logit 1); renormalised: sigmoid(1) and 1 - sigmoid(1)
    assert routing.experts.tolist() == [[0, 1], [1, 2], [0, 2], [2, 0]]
    sigmoid_1 = 1 / (1 + math.exp(-1))
    assert routing.weights[0].tolist() == pytest.approx([sigmoid_1, 1 - sigmoid_1], rel=1e-6)
    assert routing.probs[0].tolist() == pytest.approx([A, B, C], rel=1e-6)


def test_load_balancing_loss_is_the_switch_formula_over_the_routed_counts():
    moe = layer()
    moe.train()
    moe(TOKENS.view(1, 4, 3))
    # routed (token, slot) pairs per expert: 3, 2, 3 of 4 tokens; mean probabilities from the permutations
    fractions = [3 / 4, 2 / 4, 3 / 4]
    mean_probs = [(A + C + A + B) / 4, (B + A + C + C) / 4, (C + B + B + A) / 4]
    expected = 3 * sum(f * p for f, p in zip(fractions, mean_probs))
    assert moe.aux_loss.item() == pytest.approx(expected, rel=1e-6)
    stats = moe.pop_routing_stats()
    assert stats.tokens_per_expert.tolist() == [3, 2, 3] and stats.dropped.item() == 0 and stats.forwards == 1
    assert moe.pop_routing_stats() is None  # read once, then counted afresh


def test_capacity_drops_the_assignments_past_each_experts_first_places_in_token_order():
    moe = layer(capacity_factor=0.75)  # ceil(0.75 * 4 tokens * 2 / 3 experts) = 2 places per expert
    moe.train()
    out = moe(TOKENS.view(1, 4, 3)).view(4, 3)
    # expert 0's queue is tokens 0, 2, 3 and expert 2's is 1, 2, 3: token 3 loses both its experts
    assert out[3].tolist() == [0.0, 0.0, 0.0]
    weights = moe.router(TOKENS).weights
    expected_0 = weights[0, 0] * moe.experts(TOKENS[:1], 0) + weights[0, 1] * moe.experts(TOKENS[:1], 1)
    torch.testing.assert_close(out[0], expected_0[0])
    stats = moe.pop_routing_stats()
    assert stats.tokens_per_expert.tolist() == [2, 2, 2] and stats.dropped.item() == 2


def test_training_loss_adds_the_weighted_mean_of_the_blocks_load_balancing_losses():
    torch.manual_seed(0)
    model = build_gpt(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, moe_experts=4, moe_aux_loss_coef=0.5)
    tokens = torch.randint(0, 16, (2, 8))
    outputs = model(tokens)
    per_block = [block.mlp.aux_loss for block in model.blocks]
    expected_aux = (per_block[0] + per_block[1]) / 2
    ce = torch.nn.functional.cross_entropy(outputs.logits.reshape(-1, 16), tokens.reshape(-1))
    assert outputs.aux_loss.item() == pytest.approx(expected_aux.item())
    assert cross_entropy()(outputs, tokens).item() == pytest.approx(ce.item() + 0.5 * expected_aux.item(), rel=1e-6)


def test_top_k_larger_than_the_experts_is_refused_naming_both_keys():
    with pytest.raises(ValueError, match=r"model.args.moe_top_k=5 .* model.args.moe_experts=4"):
        build_gpt(moe_experts=4, moe_top_k=5)


def biased_layer() -> MoEFeedForward:
    moe = MoEFeedForward(3, 5, MoEConfig(num_experts=3, top_k=2, balance="bias", bias_update_rate=0.5))
    moe.router.gate.weight.data.copy_(torch.eye(3))
    return moe


def test_the_balance_bias_chooses_the_experts_but_the_probabilities_weight_them():
    moe = biased_layer()
    moe.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 1.0]))  # expert 2 chosen by every token
    routing = moe.router(TOKENS)
    assert routing.experts.tolist() == [[2, 0], [2, 1], [2, 0], [2, 0]]
    # token 0: experts 2 (probability C) and 0 (A), renormalised over those two, the bias left out
    assert routing.weights[0].tolist() == pytest.approx([C / (A + C), A / (A + C)], rel=1e-6)


def test_the_balance_bias_moves_by_the_rate_towards_an_even_load_each_step():
    """DeepSeek-V3's rule: bias_e += rate * sign(mean load - load_e), with the step's counts over every rank."""
    moe = biased_layer()
    moe.update_expert_bias(torch.tensor([6.0, 1.0, 2.0]))  # mean 3: expert 0 over, 1 and 2 under
    assert moe.router.expert_bias.tolist() == [-0.5, 0.5, 0.5]
    moe.update_expert_bias(torch.tensor([3.0, 3.0, 3.0]))  # balanced: nothing moves
    assert moe.router.expert_bias.tolist() == [-0.5, 0.5, 0.5]


def test_a_gpt_balanced_by_bias_trains_without_the_load_balancing_loss_and_may_be_pipelined():
    model = build_gpt(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, moe_experts=4, moe_balance="bias")
    outputs = model(torch.randint(0, 16, (2, 8)))
    assert outputs.aux_loss > 0 and outputs.weighted_aux_loss == 0  # logged, not trained on
    assert model.parallel_plan().pipeline_sequence and not model.parallel_plan().pipeline_refusal
    assert "blocks.0.mlp.router.expert_bias" in model.state_dict()  # checkpoints keep it
    with pytest.raises(ValueError, match="model.args.moe_balance='sometimes' must be 'aux_loss' or 'bias'"):
        build_gpt(moe_experts=4, moe_balance="sometimes")
