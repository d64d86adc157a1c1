"""Pipeline stages for transformers decoders, from the model's own pipeline plan.

transformers declares where a decoder can be cut (``model.pp_plan``: ``model.embed_tokens``,
``model.layers``, ``model.norm``, ``lm_head``), but its decoder layers are not ``x = layer(x)``: the base
model's forward computes the rotary position embeddings and the causal mask once and hands them to every
layer. ``DecoderLayerInputs`` computes the same from a stage's input, and a pipeline stage
(``parallel/pipeline/stages.StageModule``) hands them to the layers it holds, so a stage computes exactly
what the model's forward computes for them.

That holds only for base models whose forward is that and nothing more: the embeddings, each layer
given the rotary embeddings and its layer type's mask (full or sliding-window causal), the final norm.
``CHAINABLE`` lists the classes checked to be so (tests/unit/test_hf_models.py compares each chain with
the model's forward); any other transformers model is refused for pipelines, naming why. A model whose
embedding and head share weights (tie_word_embeddings) is refused too, since each stage owns and
updates its own weights.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# Base models whose forward is embed_tokens, then every layer(hidden, mask, rotary embeddings), then norm.
CHAINABLE = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")
# The inputs each entry of such a plan declares, in transformers' pp_plan notation.
_EXPECTED_INPUTS = {
    "embed_tokens": ["input_ids"],
    "layers": ["hidden_states", "attention_mask"],
    "norm": ["hidden_states"],
    "lm_head": ["hidden_states"],
}


def transformers_pipeline(model: nn.Module) -> dict:
    """ParallelPlan fields for a transformers causal LM: the pipeline sequence read from its ``pp_plan`` and
    what its layers need besides the hidden states, or the reason it cannot be staged. {} for other models."""
    prefix = getattr(model, "base_model_prefix", None)
    base = getattr(model, prefix, None) if prefix else None
    if base is None or not hasattr(base, "config"):
        return {}
    name = type(model).__name__
    if type(base).__name__ not in CHAINABLE:
        return {"pipeline_refusal": _refusal(name, f"its base model {type(base).__name__} is not one of them")}
    declared = _declared_pipeline(getattr(model, "pp_plan", None) or {}, prefix)
    expected = {
        (path if path == "lm_head" else f"{prefix}.{path}"): inputs for path, inputs in _EXPECTED_INPUTS.items()
    }
    if declared != expected:
        return {"pipeline_refusal": _refusal(name, f"its pp_plan {declared} is not {expected}")}
    if model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        return {"pipeline_refusal": _tied_refusal(name, prefix)}
    layers = tuple(f"{prefix}.layers.{index}" for index in range(len(base.layers)))
    return {
        "pipeline_sequence": (f"{prefix}.embed_tokens", *layers, f"{prefix}.norm", "lm_head"),
        "pipeline_layer_inputs": DecoderLayerInputs(layers, base.rotary_emb, base.config),
    }


def _declared_pipeline(pp_plan: dict, prefix: str) -> dict[str, list[str]]:
    """The pp_plan's entries (module path -> input names) for the base model, under its prefix, and the head.

    transformers 4.x also lists the base model's entries without the prefix (its own plan, leaked through
    the shared config), which name no module of the causal LM: they are left out. Releases before 5.20
    leave out the head's entry, though ``lm_head`` is the causal LM's own module taking the hidden states
    in every release, so it is taken as declared.
    """
    declared = {path: list(inputs) for path, (inputs, _) in pp_plan.items() if path.startswith(f"{prefix}.")}
    return {**declared, "lm_head": list(pp_plan.get("lm_head", (_EXPECTED_INPUTS["lm_head"], None))[0])}


def _refusal(model_name: str, why: str) -> str:
    return (
        f"transformers' {model_name} cannot be cut into pipeline stages: paratrain stages causal LMs built on "
        f"{', '.join(CHAINABLE)}, whose layers take the rotary embeddings and causal mask their forward "
        f"computes, and {why}; train this model with fsdp, hsdp, ddp or tp instead"
    )


def _tied_refusal(model_name: str, prefix: str) -> str:
    return (
        f"transformers' {model_name} cannot be cut into pipeline stages: its lm_head shares its weight with "
        f"{prefix}.embed_tokens (tie_word_embeddings), and each stage owns and updates its own weights; for a "
        f"model from scratch set model.args.tie_word_embeddings=false, or train this one with fsdp, hsdp, ddp or tp"
    )


class DecoderLayerInputs:
    """What a transformers base model's forward hands each decoder layer besides the hidden states: the
    position ids, the rotary position embeddings and the layer type's causal mask (for batches without
    padding, which is what paratrain feeds).

    Args:
        layers: Paths of all the model's decoder layers, in order (a layer's position picks its mask type).
        rotary: The base model's rotary embedding (buffers only): every stage must hold it (``modules``).
        config: The base model's config (mask type per layer, attention implementation).
    """

    def __init__(self, layers: tuple[str, ...], rotary: nn.Module, config: Any):
        self.layers, self.config = layers, config
        self.modules = [rotary]
        self.mask_kind = dict(zip(layers, _mask_kinds(config, len(layers)), strict=True))  # by layer path

    def compute(self, hidden: torch.Tensor) -> Callable[[str], dict[str, Any]]:
        """The keyword inputs of each layer, by path, for this batch's hidden states (computed once per stage)."""
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        builders = _mask_builders()
        masks = {
            kind: builders[kind](**_mask_arguments(self.config, hidden, position_ids))
            for kind in set(self.mask_kind.values())
        }
        embeddings = self.modules[0](hidden, position_ids)

        def inputs_of(path: str) -> dict[str, Any]:
            mask = masks[self.mask_kind[path]]
            return {"attention_mask": mask, "position_ids": position_ids, "position_embeddings": embeddings}

        return inputs_of


def _mask_kinds(config: Any, num_layers: int) -> list[str]:
    """Each layer's attention type: Qwen2/Qwen3 name it per layer; Mistral has one sliding window for all
    layers or none."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return list(layer_types)
    kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
    return [kind] * num_layers


@functools.cache
def _mask_builders() -> dict[str, Callable[..., Any]]:
    """transformers' mask builders by layer type (imported once)."""
    # Lazy: transformers is an optional dependency, and only its models get these inputs.
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    return {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


@functools.cache
def _mask_keywords() -> tuple[str, str, bool]:
    """The names create_causal_mask gives its embeddings and its key/value cache, and whether it takes the
    cache positions: 4.56 and 5.0 take ``input_embeds`` and require ``cache_position``; 5.5 takes
    ``inputs_embeds`` and an optional ``cache_position``, 5.12 none; 5.24 renamed ``past_key_values`` to
    ``cache``."""
    parameters = inspect.signature(_mask_builders()["full_attention"]).parameters
    embeds = "inputs_embeds" if "inputs_embeds" in parameters else "input_embeds"
    cache = "cache" if "cache" in parameters else "past_key_values"
    return embeds, cache, "cache_position" in parameters


def _mask_arguments(config: Any, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
    """The keyword arguments of transformers' mask builders for a batch without padding or cache."""
    embeds, cache, takes_cache_position = _mask_keywords()
    arguments = {"config": config, embeds: hidden, "attention_mask": None, cache: None, "position_ids": position_ids}
    if takes_cache_position:
        arguments["cache_position"] = position_ids[0]
    return arguments
