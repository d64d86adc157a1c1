"""transformers' MoE families in one process: paratrain's expert dispatch computes what the family's own
experts compute, the whole-sequence load-balancing loss is the family's own on one rank, and which families
expert parallel takes at the installed transformers (at the floor, 4.56, none: said so, naming why)."""

from __future__ import annotations

import pytest
import torch

from paratrain.errors import ConfigError
from paratrain.models.hf import causal_lm, use_whole_sequence_aux_loss
from paratrain.models.hf_experts import install_transformers_dispatch
from paratrain.models.moe import compute_experts_locally
from paratrain.models.plan_derivation import plan_of
from paratrain.parallel.expert import expert_modules

transformers = pytest.importorskip("transformers")
FUSED = int(transformers.__version__.split(".")[0]) >= 5  # transformers 5 stacks each family's experts

COMMON = {
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16,
    "num_experts_per_tok": 2,
}
FAMILIES = {
    "qwen3_moe": {"head_dim": 8, "num_experts": 4, "moe_intermediate_size": 16, "router_aux_loss_coef": 0.1},
    "mixtral": {"num_local_experts": 4, "router_aux_loss_coef": 0.1},
    "qwen2_moe": {"num_experts": 4, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16},
    "deepseek_v3": {
        "n_routed_experts": 4,
        "moe_intermediate_size": 16,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": None,
        "kv_lora_rank": 8,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 4,
        "v_head_dim": 8,
    },
}
GPT_OSS = {"head_dim": 8, "num_local_experts": 4}


def model_of(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return causal_lm(model_type=family, **{**COMMON, **(GPT_OSS if family == "gpt_oss" else FAMILIES[family])})


TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.skipif(not FUSED, reason="transformers 4.x keeps experts as separate modules, which ep refuses")
@pytest.mark.parametrize("family", FAMILIES)
def test_the_dispatch_computes_what_the_familys_own_experts_compute(family):
    model = model_of(family)
    expected = model(TOKENS).logits
    install_transformers_dispatch(model, expert_modules(model, plan_of(model)), compute_experts_locally)
    assert model.config._experts_implementation == "paratrain_expert_parallel"
    torch.testing.assert_close(model(TOKENS).logits, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_whole_sequence_aux_loss_on_one_rank_is_the_familys_own(family):
    model = model_of(family)
    expected = model(TOKENS).aux_loss
    use_whole_sequence_aux_loss(model, lambda tensor: tensor)
    outputs = model(TOKENS)
    torch.testing.assert_close(outputs.aux_loss, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(outputs.weighted_aux_loss, 0.1 * expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("family", [*FAMILIES, "gpt_oss"])
def test_expert_parallel_takes_the_checked_families_at_transformers_5_and_names_why_not_otherwise(family):
    plan = plan_of(model_of(family))
    if family == "gpt_oss":
        assert "GptOssExperts, which is not among the experts modules" in plan.expert_refusal
        assert not plan.block_experts
    elif FUSED:
        assert not plan.expert_refusal and plan.block_experts == ("mlp.experts",)
        assert list(plan.num_experts.values()) == [4]
    else:
        assert "keeps its experts as separate modules" in plan.expert_refusal
        assert "needs transformers 5" in plan.expert_refusal


@pytest.mark.skipif(not FUSED, reason="transformers 4.x's DeepSeek-V3 routes inside one module: nothing is counted")
def test_deepseek_v3s_router_bias_moves_towards_an_even_load_under_moe_balance_bias():
    torch.manual_seed(0)
    model = causal_lm(
        model_type="deepseek_v3", moe_balance="bias", moe_bias_update_rate=0.5, **COMMON, **FAMILIES["deepseek_v3"]
    )
    model.train()
    model(TOKENS)
    (recorder,) = [module for module in model.modules() if hasattr(module, "update_expert_bias")]
    stats = recorder.pop_routing_stats()
    assert stats.balance_bias and stats.tokens_per_expert.shape == (1, 4)  # layer 0 is dense
    counts = stats.tokens_per_expert[0].float()
    recorder.update_expert_bias(stats.tokens_per_expert)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.tolist() == (0.5 * torch.sign(counts.mean() - counts)).tolist()


def test_moe_balance_bias_on_a_family_without_a_router_bias_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="model.args.moe_balance='bias': transformers' Qwen3MoeForCausalLM has no"):
        causal_lm(model_type="qwen3_moe", moe_balance="bias", **COMMON, **FAMILIES["qwen3_moe"])
