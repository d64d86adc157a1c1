"""torchtitan's side of benchmarks/vs_torchtitan.py: a Llama 3 flavour shaped like Llama 3.2 1B.

torchtitan 0.2.2 (the newest release that runs on torch 2.11: 0.3.0 imports FSDP APIs that arrived after
it) names its Llama 3 shapes in ``torchtitan.models.llama3.llama3_args`` and has none near 1B; a module
given to ``--experimental.custom_import`` is imported before the model is built, so importing this one
adds the flavour ``1B_matched``: width 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192 (Llama's SwiGLU
rule with multiplier 1.5, multiple of 1024), vocabulary 128,256, RoPE theta 500,000, sdpa causal
attention (torchtitan's default). torchtitan's Llama has no tied embeddings: 1.50B parameters.

    PYTHONPATH=benchmarks torchrun --nproc-per-node 1 -m torchtitan.train \\
        --experimental.custom_import torchtitan_llama --model.name llama3 --model.flavor 1B_matched ...
"""

from __future__ import annotations

from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

FLAVOR = "1B_matched"

llama3_args[FLAVOR] = TransformerModelArgs(
    dim=2048,
    n_layers=16,
    n_heads=32,
    n_kv_heads=8,
    vocab_size=128256,
    ffn_dim_multiplier=1.5,
    multiple_of=1024,
    rope_theta=500000,
)
