"""Hugging Face ``transformers`` causal language models, built from a config (nothing downloaded).

``causal_lm`` is the model factory for both a model from scratch (``model_type`` plus config fields)
and a pretrained directory (``config_dir``; ``model.pretrained`` sets it): the architecture is built
here, the weights come from ``models.init.materialize`` (the model's own ``_init_weights`` through a
seeded build, or the directory's safetensors). transformers is the optional extra ``paratrain[hf]``.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Literal

import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.models.hf_routing import maybe_record_routing

INSTALL_HINT = "pip install 'paratrain[hf]'"


def require_transformers() -> ModuleType:
    """transformers, or a ConfigError naming the command that installs it (or a supported release of it).

    The installed release is checked before the import: one outside the range paratrain declares may
    not even import with this torch, and would otherwise fail mid-training inside its internals.
    """
    try:
        installed = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"Hugging Face models need transformers, which is not installed: {INSTALL_HINT}") from None
    check_transformers_version(installed, supported=supported_range("transformers"))
    # Lazy: an optional dependency, imported only where it is used.
    import transformers

    return transformers


def check_transformers_version(installed: str, *, supported: str) -> None:
    """Refuses a transformers release outside ``supported`` (a PEP 440 specifier such as ``>=4.56,<6``).

    Raises:
        ConfigError: naming the installed release, the supported range and the pip command that fixes it.
    """
    # Lazy: packaging is not paratrain's dependency but transformers' own, so it is there when this is asked.
    from packaging.specifiers import SpecifierSet

    if supported and installed not in SpecifierSet(supported):
        raise ConfigError(
            f"transformers {installed} is installed, but paratrain supports transformers{supported} "
            f"(the versions its tests run): pip install 'transformers{supported}'"
        )


def supported_range(package: str) -> str:
    """The version specifier paratrain's own requirements give ``package`` (e.g. ``!=5.0.*,<6,>=4.56``),
    read from the pyproject.toml of the source tree paratrain runs from, else from its installed metadata;
    "" when neither says (nothing to hold it to). The source tree comes first: an editable install's
    metadata is written once, at install, and goes stale when pyproject.toml changes after it."""
    # Lazy: packaging comes with transformers and with tensorboard (a dependency of paratrain's own).
    from packaging.requirements import Requirement

    lines = _source_requirements()
    if not lines:
        try:
            lines = importlib.metadata.requires("paratrain") or []
        except importlib.metadata.PackageNotFoundError:
            lines = []
    specifiers = [requirement.specifier for requirement in map(Requirement, lines) if requirement.name == package]
    # packaging orders them by text; a reader expects the lower bound first: >=4.56,!=5.0.*,<6
    return ",".join(sorted(map(str, specifiers[0]), key=lambda part: ">~=!<".find(part[0]))) if specifiers else ""


def _source_requirements() -> list[str]:
    """The requirements, optional ones included, in the pyproject.toml beside a source checkout (none when
    paratrain runs from an installed wheel, which has no pyproject.toml beside it)."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        import tomllib  # lazy: read only when a range is asked for; Python 3.11+ (3.10: the metadata's)
    except ImportError:
        return []
    if not pyproject.is_file():
        return []
    project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    if project.get("name") != "paratrain":
        return []
    optional = project.get("optional-dependencies", {}).values()
    return [*project.get("dependencies", []), *(line for extra in optional for line in extra)]


def is_transformers_model(model: nn.Module) -> bool:
    """Whether the model is a transformers model, which has a Hugging Face format (its config saves)."""
    return hasattr(getattr(model, "config", None), "save_pretrained")


def causal_lm(
    *,
    model_type: str | None = None,
    config_dir: str | None = None,
    moe_balance: Literal["bias"] | None = None,
    moe_bias_update_rate: float = 1e-3,
    **fields,
) -> nn.Module:
    """A ``transformers`` causal LM from a config, with its own random initialisation.

    Args:
        model_type: transformers' name of the architecture (``llama``, ``gpt2``, ``qwen2``, ...), with
            ``fields`` its config values (hidden_size, num_hidden_layers, ...).
        config_dir: Or a directory holding config.json (a pretrained model's); ``fields`` override it.
        moe_balance: ``bias``: aux-loss-free balancing of a family whose router holds a per-expert bias
            (DeepSeek-V3's ``e_score_correction_bias``, which transformers never updates): paratrain moves it
            after every step towards an even load. None: the family's own balancing (its aux loss, if any).
        moe_bias_update_rate: How far each expert's bias moves per step under ``moe_balance: bias``.

    Raises:
        ConfigError: naming model.args when neither or both are given, or the model_type is unknown.
    """
    transformers = require_transformers()
    if (model_type is None) == (config_dir is None):
        raise ConfigError(
            "model.args: give either model_type (a model from scratch) or config_dir (or model.pretrained)"
        )
    if config_dir is not None:
        config = transformers.AutoConfig.from_pretrained(config_dir, **fields)
    else:
        try:
            config = transformers.AutoConfig.for_model(model_type, **fields)
        except ValueError as error:
            raise ConfigError(f"model.args.model_type={model_type!r}: {error}") from None
    config.use_cache = False  # training computes whole sequences; a key/value cache only costs memory
    model = transformers.AutoModelForCausalLM.from_config(config)
    return maybe_record_routing(maybe_train_with_aux_loss(model), balance=moe_balance, rate=moe_bias_update_rate)


def maybe_train_with_aux_loss(model: nn.Module) -> nn.Module:
    """A transformers mixture of experts (its config has ``router_aux_loss_coef``) made to return its
    load-balancing loss weighted as its own forward adds it to a loss computed from labels, as
    ``weighted_aux_loss`` (which paratrain.losses adds): paratrain passes no labels, so the model's own
    sum never happens. Other models are returned as they are."""
    config = model.config
    if not hasattr(config, "output_router_logits") or not getattr(config, "router_aux_loss_coef", 0):
        return model
    config.output_router_logits = True  # the forward computes aux_loss only when it returns the router logits
    model.register_forward_hook(_add_weighted_aux_loss)
    for module in model.modules():
        if isinstance(getattr(module, "experts", None), nn.ModuleList):
            module.register_forward_hook(_every_expert_in_the_graph)
    return model


def _every_expert_in_the_graph(block: nn.Module, args: tuple, output):
    """Adds each expert's output on no tokens (a zero) to a mixture-of-experts block's output.

    transformers 4.x families keep their experts as a ModuleList and compute only the experts some token
    was routed to, so in a step where an expert got no tokens on one rank its parameters get no gradient
    there and a gradient on another: FSDP's reduce-scatters then disagree in size across ranks (gloo aborts:
    "Received data size doesn't match expected size") and DDP finds unused parameters. With this, every
    expert's parameters get a gradient on every rank (zero where it had no tokens); the sum is unchanged.
    """
    hidden = args[0]
    nothing = hidden.reshape(-1, hidden.shape[-1])[:0]
    zero = sum(expert(nothing).sum() for expert in block.experts)
    if isinstance(output, tuple):
        return (output[0] + zero, *output[1:])
    return output + zero


def use_whole_sequence_aux_loss(model: nn.Module, sum_over_sequence: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Under context parallel, where each rank holds part of every sequence: a transformers MoE family's
    load-balancing loss from its statistics over the whole sequences (``sum_over_sequence`` adds the cp ranks'),
    so that it equals one process's; the family's own would see this rank's tokens alone. The Switch
    Transformer loss of every family with ``router_aux_loss_coef`` (transformers' ``load_balancing_loss_func``:
    ``experts * sum_e f_e * P_e`` over all layers' tokens), replacing the output's ``aux_loss`` before the
    weighted term and the router statistics read it. Other models are left as they are."""
    if getattr(model.config, "output_router_logits", False) and getattr(model.config, "router_aux_loss_coef", 0):
        model.register_forward_hook(_whole_sequence_aux_loss(sum_over_sequence), prepend=True)


def _whole_sequence_aux_loss(sum_over_sequence: Callable[[torch.Tensor], torch.Tensor]):
    def hook(model: nn.Module, inputs, outputs):
        router_logits = getattr(outputs, "router_logits", None)
        if getattr(outputs, "aux_loss", None) is None or not router_logits:
            return outputs
        probs = torch.softmax(torch.cat([layer.float() for layer in router_logits]), dim=-1)
        chosen = probs.topk(model.config.num_experts_per_tok, dim=-1).indices.reshape(-1)
        experts = probs.shape[-1]
        counts = torch.zeros(experts, device=probs.device).index_add_(
            0, chosen, torch.ones_like(chosen, dtype=probs.dtype)
        )
        rows = torch.full((1,), float(probs.shape[0]), device=probs.device)
        summed = sum_over_sequence(torch.cat([counts, probs.sum(dim=0), rows]))
        counts, probability, rows = summed[:experts].detach(), summed[experts:-1], summed[-1].detach()
        outputs["aux_loss"] = experts * torch.sum(counts / rows * probability / rows)
        return outputs

    return hook


def _add_weighted_aux_loss(model: nn.Module, inputs, outputs):
    if getattr(outputs, "aux_loss", None) is not None:
        outputs["weighted_aux_loss"] = model.config.router_aux_loss_coef * outputs.aux_loss
    return outputs
