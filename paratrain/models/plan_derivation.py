"""The parallel plan a model declares beside its modules, as data.

Models carry no training infrastructure. They only say how they may be cut: which submodules are the
repeated blocks (the units that FSDP shards, activation checkpointing wraps and pipeline stages split
between). Layouts read the plan; they never guess at a model's structure.
"""

from __future__ import annotations

import re

from torch import nn

from paratrain.models.contract import ParallelPlan, TensorParallelStyle, declared_plan
from paratrain.models.hf_experts import transformers_experts
from paratrain.models.hf_pipeline import transformers_pipeline

__all__ = ["ParallelPlan", "TensorParallelStyle", "plan_of"]  # ParallelPlan is defined in models/contract.py


def plan_of(model: nn.Module) -> ParallelPlan:
    """The plan a model declares (``contract.DeclaresParallelPlan``); for an ``nn.Sequential`` without
    one, its children as the pipeline sequence; for a Hugging Face model, its blocks from
    ``_no_split_modules``, its tensor-parallel styles from ``tp_plan`` and its stages from its pp_plan;
    otherwise an empty plan."""
    declared = declared_plan(model)
    if declared is not None:
        return declared
    if isinstance(model, nn.Sequential):
        return ParallelPlan(pipeline_sequence=tuple(name for name, _ in model.named_children()))
    blocks = no_split_blocks(model)
    experts = transformers_experts(model, blocks)
    return ParallelPlan(
        blocks=blocks,
        outer_units=transformers_outer_units(model, blocks),
        attention_heads=transformers_attention_heads(model),
        **experts,
        **transformers_tensor_parallel(model, blocks, experts=experts.get("block_experts", ())),
        **transformers_pipeline(model),
    )


# Styles of transformers' tp_plan that paratrain applies (parallel/tensor.py says how); the expert styles of
# mixture-of-experts plans (packed_colwise, moe_tp_experts) are not among them: experts stay whole per tp rank.
_TRANSFORMERS_STYLES: dict[str, TensorParallelStyle] = {
    **{
        style: style
        for style in (
            "colwise",
            "rowwise",
            "colwise_gather_output",
            "rowwise_split_input",
            "replicated_with_grad_allreduce",
        )
    },
    # transformers 4.x names of the same torch styles (ColwiseParallel(output_layouts=Replicate()) and
    # RowwiseParallel(input_layouts=Replicate())), which Phi-3's and OLMo2's plans use there.
    "colwise_rep": "colwise_gather_output",
    "rowwise_rep": "rowwise_split_input",
}


def transformers_tensor_parallel(model: nn.Module, blocks: tuple[str, ...], *, experts: tuple[str, ...] = ()) -> dict:
    """The block-level part of a transformers model's own ``tp_plan`` (e.g. ``model.layers.*.self_attn.q_proj:
    colwise``) as ParallelPlan fields, and the head counts tensor parallel must divide. Entries outside the
    blocks (embeddings, head) are left out: those stay whole on every rank, as in paratrain's own GPT. So are
    the entries of the stacked experts at ``experts`` (paths inside a block), listed as ``tp_left_whole``:
    each tp rank routes the same tokens through whole experts, which expert parallel divides."""
    tp_plan = getattr(model, "tp_plan", None) or {}
    if not blocks or not tp_plan:
        return {}
    prefix = re.sub(r"\.\d+$", ".*", blocks[0]) + "."
    inside = {key.removeprefix(prefix): style for key, style in tp_plan.items() if key.startswith(prefix)}
    whole = {path: style for path, style in inside.items() if any(_at_or_under(path, e) for e in experts)}
    inside = {path: style for path, style in inside.items() if path not in whole}
    supported = {path: _TRANSFORMERS_STYLES[style] for path, style in inside.items() if style in _TRANSFORMERS_STYLES}
    supported |= _per_head_norms_left_out(model.get_submodule(blocks[0]), supported)
    unsupported = tuple(f"{path}: {style}" for path, style in inside.items() if style not in _TRANSFORMERS_STYLES)
    heads = transformers_attention_heads(model)
    return {
        "block_tp_plan": {} if unsupported else supported,
        "tp_unsupported": unsupported,
        "tp_divisible": heads,
        "tp_left_whole": tuple(f"{path}: {style}" for path, style in whole.items()),
    }


def _at_or_under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent + ".")


def _per_head_norms_left_out(block: nn.Module, styles: dict[str, TensorParallelStyle]) -> dict:
    """``replicated_with_grad_allreduce`` for a per-head ``q_norm``/``k_norm`` after a colwise ``q_proj``/``k_proj``
    that the plan does not name. transformers 4.x plans leave out Qwen3's: with the heads split over tp, each
    rank's copy of the norm's weight sees only its own heads, so its gradient must be summed over the tp
    ranks (5.x plans name the style); left plain, the tp ranks' weights would drift apart."""
    added = {}
    for path, style in styles.items():
        parent, _, leaf = path.rpartition(".")
        if style != "colwise" or leaf not in ("q_proj", "k_proj"):
            continue
        norm = f"{parent}.{leaf[0]}_norm" if parent else f"{leaf[0]}_norm"
        if norm not in styles and _has_submodule(block, norm):
            added[norm] = "replicated_with_grad_allreduce"
    return added


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def transformers_attention_heads(model: nn.Module) -> dict[str, int]:
    """The query and key/value head counts of a transformers model's config, by config key."""
    config = getattr(model, "config", None)
    return {
        f"model.args.{name}": getattr(config, name)
        for name in ("num_attention_heads", "num_key_value_heads")
        if isinstance(getattr(config, name, None), int)
    }


def transformers_outer_units(model: nn.Module, blocks: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """A transformers model's input embedding, and its final norm (the base model's one module with
    parameters registered after the blocks) with its head, as FSDP units; () when the head shares the
    embedding's weight (tied: one parameter must stay in one unit, so the root keeps both)."""
    get_input, get_output = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if not blocks or not callable(get_input) or not callable(get_output):
        return ()
    embedding, head = get_input(), get_output()
    if embedding is None or head is None or head.weight is embedding.weight:
        return ()
    paths = {id(module): path for path, module in model.named_modules()}
    base_path, _, container = blocks[0].rpartition(".")[0].rpartition(".")  # "model", "layers"
    base = model.get_submodule(base_path)
    names = [name for name, _ in base.named_children()]
    after_blocks = [base.get_submodule(name) for name in names[names.index(container) + 1 :]]
    norms = [
        paths[id(child)] for child in after_blocks if child is not head and next(child.parameters(), None) is not None
    ]
    final_norm = (norms[0],) if len(norms) == 1 else ()
    return ((paths[id(embedding)],), (*final_norm, paths[id(head)]))


def no_split_blocks(model: nn.Module) -> tuple[str, ...]:
    """Paths of the outermost submodules whose class a transformers model names in ``_no_split_modules``
    (its decoder layers: what Accelerate and transformers' own FSDP wrapping take as units), in
    registration order, which is forward order for transformers' decoders."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks: list[str] = []
    for path, module in model.named_modules():
        inside_a_block = any(path.startswith(block + ".") for block in blocks)
        if path and not inside_a_block and type(module).__name__ in names:
            blocks.append(path)
    return tuple(blocks)
