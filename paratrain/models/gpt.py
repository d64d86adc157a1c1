"""A small GPT-style decoder (after nanoGPT), used as a character-level language model."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models.moe import MoEBalance, MoEConfig, MoEFeedForward
from paratrain.models.plan_derivation import ParallelPlan


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
    moe: MoEConfig | None = None  # None: a dense feed-forward in every block


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
        self.mlp = FeedForward(config) if config.moe is None else _moe_feed_forward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def _moe_feed_forward(config: GPTConfig) -> MoEFeedForward:
    return MoEFeedForward(config.n_embd, 4 * config.n_embd, config.moe, dropout=config.dropout)


@dataclass
class MoEOutput:
    """A mixture-of-experts GPT's forward: the logits, and the load-balancing term its training loss adds
    (``weighted_aux_loss``, read by paratrain.losses) beside the unweighted mean over blocks (``aux_loss``)."""

    logits: torch.Tensor
    aux_loss: torch.Tensor
    weighted_aux_loss: torch.Tensor


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
        if c.moe is not None:
            return _moe_plan(self.parallel_dense_plan(), c.moe)
        return self.parallel_dense_plan()

    def parallel_dense_plan(self) -> ParallelPlan:
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
        document masking: paratrain.parallel.sequence_sharding)."""
        # Modules, not attributes: a pipeline stage keeps only some pieces (the others are placeholders).
        for module in self.modules():
            if isinstance(module, Embedding):
                module.positions = positions
            elif isinstance(module, CausalSelfAttention):
                module.attend = attention

    def use_expert_dispatch(self, dispatch) -> None:
        """How every MoE feed-forward hands its tokens to the experts, from a layout (expert parallel:
        paratrain.parallel.expert)."""
        for module in self.modules():
            if isinstance(module, MoEFeedForward):
                module.dispatch = dispatch

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
            residual = name.endswith(("out_proj.weight", "down_proj.weight", "experts.down_proj"))
            std = 0.02 / math.sqrt(2 * self.config.n_layer) if residual else 0.02
            nn.init.normal_(tensor, mean=0.0, std=std, generator=generator)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·N for the non-embedding parameters' matmuls (forward 2·N, backward
        4·N) plus 12·L·d·S for attention scores and their use (PaLM, appendix B). For throughput/MFU."""
        # numel of a DTensor (fsdp, tp) is the full parameter's: every layout counts the whole model.
        non_embedding = sum(p.numel() for name, p in self.named_parameters() if not name.startswith("embed."))
        return 6.0 * non_embedding + 12.0 * self.config.n_layer * self.config.n_embd * seq_len

    def forward(self, tokens: torch.Tensor) -> torch.Tensor | MoEOutput:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.final_norm(x))
        if self.config.moe is None:
            return logits
        aux_loss = torch.stack([block.mlp.aux_loss for block in self.blocks]).mean()
        return MoEOutput(logits, aux_loss, self.config.moe.aux_loss_coef * aux_loss)


def _moe_plan(dense: ParallelPlan, moe: MoEConfig) -> ParallelPlan:
    """The dense plan without the feed-forward's tensor-parallel styles, and without a pipeline when the
    load-balancing loss is on: the loss function sees only the last stage's output, so earlier stages'
    blocks would train without it.

    Under tp the attention is split and the MoE feed-forward stays whole on every tp rank: its input is
    the replicated residual stream, so each tp rank routes the same tokens to the same experts and gets
    the same gradients, like the norms (torchtitan instead splits each expert over tp too). Experts are
    divided by expert parallel, over ranks of dp_shard x cp, which tp does not touch."""
    attention = {path: style for path, style in dense.block_tp_plan.items() if not path.startswith("mlp.")}
    refusal = (
        f"model.args.moe_experts={moe.num_experts} with model.args.moe_aux_loss_coef={moe.aux_loss_coef}: under a "
        "pipeline the load-balancing loss of blocks on earlier stages cannot reach the loss function; set "
        "model.args.moe_aux_loss_coef=0 to train under pp, or use fsdp/ddp"
    )
    return dataclasses.replace(
        dense,
        block_tp_plan=attention,
        block_experts=("mlp.experts",),
        num_experts={"model.args.moe_experts": moe.num_experts},
        pipeline_sequence=dense.pipeline_sequence if moe.aux_loss_coef == 0 else (),
        pipeline_refusal="" if moe.aux_loss_coef == 0 else refusal,
    )


def build_gpt(
    *,
    vocab_size: int = 128,
    block_size: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 64,
    dropout: float = 0.0,
    moe_experts: int = 0,
    moe_top_k: int = 2,
    moe_aux_loss_coef: float = 0.01,
    moe_capacity_factor: float | None = None,
    moe_balance: MoEBalance = "aux_loss",
    moe_bias_update_rate: float = 1e-3,
) -> GPT:
    """Factory for config files: ``model.factory: paratrain.models.gpt:build_gpt``.

    Args:
        moe_experts: Experts in each block's mixture-of-experts feed-forward; 0: a dense feed-forward.
        moe_top_k: Experts each token is routed to.
        moe_aux_loss_coef: Weight of the load-balancing loss added to the training loss.
        moe_capacity_factor: Tokens an expert computes per forward, as a multiple of an even share
            (``tokens * top_k / experts``); the assignments over it are dropped and counted. None: no limit.
        moe_balance: ``aux_loss``: the load-balancing loss in the training loss. ``bias``: aux-loss-free
            balancing (DeepSeek-V3): a per-expert bias on the router's scores chooses the experts, moved after
            every step towards an even load; the loss is logged but not trained on (moe_aux_loss_coef unused).
        moe_bias_update_rate: How far each expert's bias moves per step under ``moe_balance: bias``.

    Raises:
        ValueError: naming the model.args key when the sizes do not fit together.
    """
    if n_embd % n_head:
        raise ValueError(f"model.args.n_embd={n_embd} must be divisible by model.args.n_head={n_head}")
    moe = _moe_config(moe_experts, moe_top_k, moe_aux_loss_coef, moe_capacity_factor)
    if moe is not None:
        moe = _balanced(moe, moe_balance, moe_bias_update_rate)
    return GPT(GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd, dropout, moe))


def _balanced(moe: MoEConfig, balance: str, rate: float) -> MoEConfig:
    if balance not in ("aux_loss", "bias"):
        raise ValueError(f"model.args.moe_balance={balance!r} must be 'aux_loss' or 'bias'")
    if rate <= 0:
        raise ValueError(f"model.args.moe_bias_update_rate={rate} must be positive (DeepSeek-V3 uses 0.001)")
    if balance == "aux_loss":
        return moe
    # The loss stays computed and logged; its weight is 0, so a pipeline may also take this model.
    return dataclasses.replace(moe, aux_loss_coef=0.0, balance="bias", bias_update_rate=rate)


def _moe_config(experts: int, top_k: int, aux_loss_coef: float, capacity_factor: float | None) -> MoEConfig | None:
    if experts < 0:
        raise ValueError(f"model.args.moe_experts={experts} must be 0 (dense) or a number of experts")
    if experts and not 1 <= top_k <= experts:
        raise ValueError(
            f"model.args.moe_top_k={top_k} must be between 1 and model.args.moe_experts={experts}: "
            "a token cannot be routed to more experts than a block has"
        )
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(f"model.args.moe_capacity_factor={capacity_factor} must be positive, or null for no limit")
    return MoEConfig(experts, top_k, aux_loss_coef, capacity_factor) if experts else None
