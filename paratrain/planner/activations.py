"""Activation memory per rank: a formula for GPT-like models, a measurement on the meta device for others.

GPT-like models (see docs/planner.md): each transformer layer keeps, per micro-batch, 18 tensors of
s x b x h elements for backward (counted from paratrain's GPT block after Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", Table 2, without dropout masks and
without the s x s score matrix, which fused scaled_dot_product_attention kernels do not keep):

    norm inputs 2 + attention input 1 + q, k, v 3 + attention output 1 + out_proj input 1
    + MLP input 1 + GELU input 4 + down_proj input 4 = 18

Other decoders differ from that block in two places, and the count follows their widths: k and v have
kv_heads/heads of q's width (grouped-query attention), and the MLP keeps 2 tensors of its inner width f
(activation input, down_proj input; GPT: 2 x 4h = 8) or, gated (SwiGLU: down(act(gate(x)) * up(x))), 4
(gate and up outputs, the activation's output, down_proj input). Llama's counts 18 - 2 (1 - kv/heads)
+ (4 f/h - 8): 22.5 with 2 of 8 key/value heads and f = 3.5h, which is what autograd saves in a real
forward of transformers' Llama.

Tensor parallel splits the tensors inside the column/row-parallel pair (14 of GPT's 18); sequence parallel also the 4 left.
Full activation checkpointing keeps only each layer's input (1), and recomputes one layer at a time.
Selective checkpointing keeps the layer's input and the outputs of the operators it saves
(parallel/activation.py: matmuls, attention, tensor parallel's reductions), 11 in all for paratrain's GPT
block (Linear layers with biases, so every projection is one addmm):

    layer input 1 + q, k, v 3 + attention output 1 + up_proj output 4 (inside tensor parallel's pair: / tp)
    + out_proj and down_proj outputs 2 (a row-parallel layer's local output is whole on every tp rank,
    and under tp > 1 the all-reduced copy is kept as well: 2 more, or 2 / tp reduce-scattered under
    sequence parallel) = 11

and backward rebuilds the other 7 (norm and GELU outputs, residual sums) one layer at a time. Under
activation_checkpointing_every = k only every k-th layer a rank holds is checkpointed; the rest keep 18.
The head adds the final norm's and LM head's inputs, the logits (b x s x vocab, in the compute dtype)
and the loss's fp32 log-softmax.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from paratrain.planner.model_facts import TransformerSizes

LAYER_TENSORS = 18  # s x b x h tensors one layer of paratrain's GPT keeps for backward
LAYER_TENSORS_OUTSIDE_TP = 4  # of which outside the tensor-parallel region: two norm inputs, qkv and MLP inputs
GPT_MLP_TENSORS = 8  # of which the MLP's: GELU input and down_proj input, 4h each
SELECTIVE_INSIDE_TP = 8  # kept by selective checkpointing inside the pair: q, k, v, attention and up_proj outputs
SELECTIVE_ROW_OUTPUTS = 2  # and the two row-parallel layers' outputs (out_proj, down_proj)


@dataclass(frozen=True)
class ActivationShape:
    """What decides one rank's activations: sizes, micro-batch, layout options."""

    micro_batch: int
    element_bytes: int  # 2 under bf16/fp16 autocast, 4 in fp32
    tp: int = 1
    sequence_parallel: bool = False
    checkpointing: Literal["none", "full", "selective"] = "none"
    cp: int = 1  # context parallel: a rank holds seq_len / cp tokens of each sample
    checkpoint_every: int = 1  # activation_checkpointing_every: every k-th layer is checkpointed


def layers_bytes(sizes: TransformerSizes, shape: ActivationShape, *, num_layers: int) -> float:
    """Bytes ``num_layers`` consecutive layers keep for backward: every k-th of them checkpointed as
    ``shape.checkpointing`` says, the others keeping everything."""
    checkpointed = num_layers // shape.checkpoint_every if shape.checkpointing != "none" else 0
    plain = replace(shape, checkpointing="none")
    return checkpointed * layer_bytes(sizes, shape) + (num_layers - checkpointed) * layer_bytes(sizes, plain)


def layer_tensors(sizes: TransformerSizes) -> float:
    """s x b x h tensors one layer keeps: the GPT block's 18, with k, v and the MLP at this model's widths."""
    kv_share = (sizes.kv_heads or sizes.heads) / sizes.heads
    mlp_width = (sizes.ffn_hidden or 4 * sizes.hidden) / sizes.hidden
    mlp = (4 if sizes.gated_mlp else 2) * mlp_width
    return LAYER_TENSORS - 2 * (1 - kv_share) + mlp - GPT_MLP_TENSORS


def layer_bytes(sizes: TransformerSizes, shape: ActivationShape) -> float:
    """Bytes one transformer layer keeps for backward for one micro-batch (see the module docstring)."""
    tensor = sizes.seq_len / shape.cp * shape.micro_batch * sizes.hidden * shape.element_bytes
    layer_input = tensor / (shape.tp if shape.sequence_parallel else 1)
    if shape.checkpointing == "full":
        return layer_input
    if shape.checkpointing == "selective":
        return layer_input + _selective_outputs(shape) * tensor
    if shape.sequence_parallel:
        return layer_tensors(sizes) * tensor / shape.tp
    inside = layer_tensors(sizes) - LAYER_TENSORS_OUTSIDE_TP
    return (LAYER_TENSORS_OUTSIDE_TP + inside / shape.tp) * tensor


def _selective_outputs(shape: ActivationShape) -> float:
    """The operator outputs selective checkpointing keeps, in s x b x h tensors (module docstring)."""
    if shape.tp == 1:
        return SELECTIVE_INSIDE_TP + SELECTIVE_ROW_OUTPUTS
    reduced = 1 / shape.tp if shape.sequence_parallel else 1
    return SELECTIVE_INSIDE_TP / shape.tp + SELECTIVE_ROW_OUTPUTS * (1 + reduced)


def recompute_bytes(sizes: TransformerSizes, shape: ActivationShape) -> float:
    """Under checkpointing, backward rebuilds one layer's activations at a time: all of them (full), or
    those selective checkpointing did not keep."""
    if shape.checkpointing == "none":
        return 0.0
    everything = layer_bytes(sizes, replace(shape, checkpointing="none"))
    return everything - layer_bytes(sizes, shape) if shape.checkpointing == "selective" else everything


def head_bytes(sizes: TransformerSizes, shape: ActivationShape) -> float:
    """The final norm's and LM head's inputs, the logits (compute dtype) and the loss's fp32 log-softmax
    (the head is not tensor parallel)."""
    tokens = sizes.seq_len / shape.cp * shape.micro_batch
    return tokens * (2 * sizes.hidden * shape.element_bytes + sizes.vocab * (shape.element_bytes + 4))


def measure_saved_bytes(model: nn.Module, inputs: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for backward in one forward of ``model`` on ``inputs``,
    plus the output: the activations of any model, measured without memory when both are on meta.

    Parameters (and views of them) are left out: they are counted as model state. Views of one tensor
    (q, k and v projections all save views of the same norm output) count once, at the base's size.
    On the meta device scaled_dot_product_attention takes its math path, which keeps the s x s scores
    that fused GPU kernels do not.
    """
    params = {id(param) for param in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in params:
            saved[id(base)] = base.numel() * base.element_size()
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        output = model(inputs)
    logits = getattr(output, "logits", output)  # a transformers model returns its logits in an output object
    return sum(saved.values()) + (logits.numel() * logits.element_size() if isinstance(logits, torch.Tensor) else 0)
