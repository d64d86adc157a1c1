"""Hugging Face ``transformers`` causal language models, built from a config (nothing downloaded).

``causal_lm`` is the model factory for both a model from scratch (``model_type`` plus config fields)
and a pretrained directory (``config_dir``; ``model.pretrained`` sets it): the architecture is built
here, the weights come from ``models.init.materialize`` (the model's own ``_init_weights`` through a
seeded build, or the directory's safetensors). transformers is the optional extra ``paratrain[hf]``.
"""

from __future__ import annotations

from types import ModuleType

from torch import nn

from paratrain.errors import ConfigError

INSTALL_HINT = "pip install 'paratrain[hf]'"


def require_transformers() -> ModuleType:
    """transformers, or a ConfigError naming the command that installs it."""
    try:
        # Lazy: an optional dependency, imported only where it is used.
        import transformers
    except ImportError:
        raise ConfigError(f"Hugging Face models need transformers, which is not installed: {INSTALL_HINT}") from None
    return transformers


def is_transformers_model(model: nn.Module) -> bool:
    """Whether the model is a transformers model, which has a Hugging Face format (its config saves)."""
    return hasattr(getattr(model, "config", None), "save_pretrained")


def causal_lm(*, model_type: str | None = None, config_dir: str | None = None, **fields) -> nn.Module:
    """A ``transformers`` causal LM from a config, with its own random initialisation.

    Args:
        model_type: transformers' name of the architecture (``llama``, ``gpt2``, ``qwen2``, ...), with
            ``fields`` its config values (hidden_size, num_hidden_layers, ...).
        config_dir: Or a directory holding config.json (a pretrained model's); ``fields`` override it.

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
    return transformers.AutoModelForCausalLM.from_config(config)
