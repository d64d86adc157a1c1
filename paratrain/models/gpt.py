"""A small GPT-style decoder (after nanoGPT), used as a character-level language model."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models.plan import ParallelPlan


def causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, dropout_p: float = 0.0
) -> torch.Tensor:
    """The attention kernel a block uses unless a layout installs another (``GPT.use_sequence_functions``)."""
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, dropout_p=dropout_p)


def count_positions(tokens: torch.Tensor) -> torch.Tensor:
    """Positions 0, 1, ... of a ``(batch, seq)`` token tensor's columns, as ``(1, seq)``."""
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 128
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.q_proj = nn.Linear(config.n_embd, config.n_embd)
        self.k_proj = nn.Linear(config.n_embd, config.n_embd)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd)
        self.out_proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout
        self.attend = causal_attention  # (q, k, v, dropout_p) -> output; context parallel installs its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 rather than n_embd // n_head: under tensor parallel each rank holds a slice of the heads.
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for proj in self._qkv())
        dropout = self.dropout if self.training else 0.0
        y = self.attend(q, k, v, dropout_p=dropout)
        return self.out_proj(y.transpose(1, 2).reshape(batch, seq, -1))

    @property
    def head_dim(self) -> int:
        return self.q_proj.in_features // self.n_head

    def _qkv(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.q_proj, self.k_proj, self.v_proj


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.down_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.gelu(self.up_proj(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.n_embd)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Embedding(nn.Module):
    """Token plus learned position embeddings: the first piece of a pipeline (tokens in, activations out)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos = nn.Embedding(config.block_size, config.n_embd)
        self.positions = count_positions  # tokens -> their positions; context parallel installs its own

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens) + self.pos(self.positions(tokens))


class GPT(nn.Module):
    """Token and position embeddings, a stack of pre-norm blocks, and an untied LM head.

    The head is untied from the embedding so each block boundary is a clean cut for pipeline stages.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.final_norm = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.reset_parameters()

    def parallel_plan(self) -> ParallelPlan:
        c = self.config
        return ParallelPlan(
            blocks=tuple(f"blocks.{i}" for i in range(len(self.blocks))),
            block_tp_plan={
                "attn.q_proj": "colwise",
                "attn.k_proj": "colwise",
                "attn.v_proj": "colwise",
                "attn.out_proj": "rowwise",
                "mlp.up_proj": "colwise",
                "mlp.down_proj": "rowwise",
            },
            block_norms=("attn_norm", "mlp_norm"),
            tp_divisible={"model.args.n_head": c.n_head, "model.args.n_embd": c.n_embd},
            attention_heads={"model.args.n_head": c.n_head},
            pipeline_sequence=("embed", *(f"blocks.{i}" for i in range(len(self.blocks))), "final_norm", "lm_head"),
        )

    def use_sequence_functions(self, *, attention, positions) -> None:
        """Every block's attention kernel and the embedding's positions, from a layout (context parallel,
        document masking: paratrain.parallel.sequence)."""
        # Modules, not attributes: a pipeline stage keeps only some pieces (the others are placeholders).
        for module in self.modules():
            if isinstance(module, Embedding):
                module.positions = positions
            elif isinstance(module, CausalSelfAttention):
                module.attend = attention

    def reset_parameters(self) -> None:
        """GPT-2 initialisation from the global RNG, for use outside paratrain."""
        for name, param in self.named_parameters():
            self.init_parameter(name, param.data, None)

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator | None) -> None:
        """GPT-2 initialisation of one full tensor, by name; residual projections scaled by depth."""
        if name.endswith("bias"):
            nn.init.zeros_(tensor)
        elif "norm" in name:
            nn.init.ones_(tensor)
        else:
            residual = name.endswith(("out_proj.weight", "down_proj.weight"))
            std = 0.02 / math.sqrt(2 * self.config.n_layer) if residual else 0.02
            nn.init.normal_(tensor, mean=0.0, std=std, generator=generator)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·N for the non-embedding parameters' matmuls (forward 2·N, backward
        4·N) plus 12·L·d·S for attention scores and their use (PaLM, appendix B). For throughput/MFU."""
        # numel of a DTensor (fsdp, tp) is the full parameter's: every layout counts the whole model.
        non_embedding = sum(p.numel() for name, p in self.named_parameters() if not name.startswith("embed."))
        return 6.0 * non_embedding + 12.0 * self.config.n_layer * self.config.n_embd * seq_len

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x))


def build_gpt(
    *,
    vocab_size: int = 128,
    block_size: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 64,
    dropout: float = 0.0,
) -> GPT:
    """Factory for config files: ``model.factory: paratrain.models.gpt:build_gpt``."""
    if n_embd % n_head:
        raise ValueError(f"model.args.n_embd={n_embd} must be divisible by model.args.n_head={n_head}")
    return GPT(GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd, dropout))
