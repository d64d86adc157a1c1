"""Tensor parallel from each popular transformers family's own tp_plan, every style those plans use inside
the decoder layers (colwise, rowwise, colwise_gather_output, rowwise_split_input,
replicated_with_grad_allreduce), trains like a single process: tp x2 against one process on the same seed
and batch. Llama's own tp x2 and fsdp+tp 2x2 are in test_hf_matches_single.py."""

from __future__ import annotations

import pytest

from paratrain.models.hf import causal_lm
from paratrain.models.plan_derivation import plan_of
from tests.harness import LayoutRuns, assert_matches_single_process

pytestmark = pytest.mark.timeout(900)

STEPS = 12
LOSS_RTOL = 1e-5
COMMON = "vocab_size: 128, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, max_position_embeddings: 16"
# Each family's tiny config: 4 query heads over 2 key/value heads where the family has grouped-query attention.
FAMILIES = {
    "mistral": "num_attention_heads: 4, num_key_value_heads: 2",
    "qwen2": "num_attention_heads: 4, num_key_value_heads: 2",
    "qwen3": "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8",  # q_norm, k_norm per head
    "gemma": "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8",
    "phi3": "num_attention_heads: 4, num_key_value_heads: 2, pad_token_id: 0",  # fused qkv and gate_up
    "olmo2": "num_attention_heads: 4, num_key_value_heads: 2",  # q_norm, k_norm over all heads
}
STYLES = {
    "mistral": {"colwise", "rowwise"},
    "qwen2": {"colwise", "rowwise"},
    "qwen3": {"colwise", "rowwise", "replicated_with_grad_allreduce"},
    "gemma": {"colwise", "rowwise"},
    "phi3": {"colwise_gather_output", "rowwise_split_input"},
    "olmo2": {"colwise", "rowwise", "colwise_gather_output", "rowwise_split_input"},
}


def _model(family: str) -> list[str]:
    return [
        "model.factory=paratrain.models.hf:causal_lm",
        f"model.args={{model_type: {family}, {COMMON}, {FAMILIES[family]}}}",
    ]


LAYOUTS = {
    **{f"{family} single": (_model(family), 1) for family in FAMILIES},
    **{f"{family} tp x2": (_model(family) + ["parallel.tp=2"], 2) for family in FAMILIES},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> LayoutRuns:
    return LayoutRuns(
        tmp_path_factory.mktemp("tp-families"),
        LAYOUTS,
        together=tuple(LAYOUTS),
        train={"max_steps": STEPS},
        debug={"dump_gradients_at_steps": [1]},
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_the_familys_plan_uses_the_styles_this_test_covers(family):
    args = dict(item.split(": ") for item in f"{COMMON}, {FAMILIES[family]}".split(", "))
    model = causal_lm(model_type=family, **{key: int(value) for key, value in args.items()})
    plan = plan_of(model)
    assert not plan.tp_unsupported
    assert set(plan.block_tp_plan.values()) == STYLES[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_of_the_familys_own_plan_matches_a_single_process(runs, family):
    reference, laid_out = runs.get(f"{family} single"), runs.get(f"{family} tp x2")
    assert_matches_single_process(reference, laid_out, steps=STEPS, loss_rtol=LOSS_RTOL)
