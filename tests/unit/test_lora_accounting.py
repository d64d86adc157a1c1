"""The planner and the memory preflight count a LoRA run's frozen base without gradients or optimizer state."""

from __future__ import annotations

import pytest

from paratrain.config.schema import ModelConfig, OptimConfig
from paratrain.parallel.dims import ParallelDims
from paratrain.planner.accounting import model_state_bytes
from paratrain.planner.model_facts import read_model_facts

pytest.importorskip("peft")

LLAMA = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
}


def test_lora_model_state_is_the_frozen_base_plus_the_adapters_with_their_gradients_and_moments():
    dims = ParallelDims.resolve(strategy="fsdp", world_size=2)
    optim = OptimConfig()
    full = read_model_facts(ModelConfig(factory="paratrain.models.hf:causal_lm", args=LLAMA))
    lora = read_model_facts(
        ModelConfig(factory="paratrain.models.hf:causal_lm", args=LLAMA, lora={"r": 4, "target_modules": ["q_proj"]})
    )
    params, grads, moments = model_state_bytes(full.params, dims=dims, optim=optim)
    lora_params, lora_grads, lora_moments = model_state_bytes(lora.params, dims=dims, optim=optim)
    adapters = 2 * 2 * 4 * 64  # 2 layers x (A: 4 x 64, B: 64 x 4)
    assert lora_params == params + 4 * adapters // 2  # fp32, sharded over 2 ranks
    assert lora_grads == 4 * adapters // 2 and grads == params
    assert lora_moments == 2 * lora_grads + 4 * 4  # exp_avg, exp_avg_sq and a step per adapter tensor
