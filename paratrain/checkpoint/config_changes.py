"""Comparing the config a checkpoint was trained with against the one resuming it.

A resume continues a run, so a change that alters what is being trained (the model, the data and
its order, the loss, the optimizer and its schedule, the seed, the global batch, gradient clipping)
would silently make the result neither run. Those are refused unless
``checkpoint.allow_config_change`` is set. Every other change is how or how often the same training
is computed or reported (layout and degrees, precision, micro-batch size, device, logging,
checkpointing, run name and directory) and is only listed. ``train.max_steps`` alters the math only
under the cosine schedule, which decays the learning rate towards it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratrain.config.loading import flatten_dotted
from paratrain.errors import ConfigError

logger = logging.getLogger("paratrain")

# Dotted keys, or whole sections, whose change alters the training math.
MATH_KEYS = (
    "train.global_batch_size",
    "train.seed",
    "train.grad_clip",
    "model",
    "data.factory",
    "data.args",
    "data.shuffle",
    "loss",
    "optim",
)
OVERRIDE_KEY = "checkpoint.allow_config_change"


@dataclass(frozen=True)
class ConfigChanges:
    """Changed keys as ``key: old -> new`` lines."""

    math: list[str]
    harmless: list[str]


def compare_configs(saved: dict[str, Any], current: dict[str, Any]) -> ConfigChanges:
    """The keys whose values differ, factory arguments one by one. A schema key missing on one side
    (a config written by another paratrain version) is skipped: that version behaved as the default."""
    old, new = flatten_dotted(saved), flatten_dotted(current)
    math, harmless = [], []
    for key in sorted(old.keys() | new.keys()):
        before, after = _section_or(old, key), _section_or(new, key)
        if before == after or ((before is _UNSET or after is _UNSET) and not _is_factory_argument(key)):
            continue
        if "." in key and key.rsplit(".", 1)[0] in old.keys() | new.keys():
            continue  # a key of a section set on one side only (model.lora): reported once, as the section
        (math if _alters_math(key, current) else harmless).append(f"{key}: {before!r} -> {after!r}")
    return ConfigChanges(math, harmless)


def check_resume_config(
    saved: dict[str, Any], current: dict[str, Any], *, checkpoint: Path, allow_change: bool
) -> ConfigChanges:
    """The changes between the checkpoint's config and the current one.

    Raises:
        ConfigError: the training math changed and ``checkpoint.allow_config_change`` is not set;
            the message lists each changed key and names the override.
    """
    changes = compare_configs(saved, current)
    if changes.math and not allow_change:
        listed = "\n".join(f"  {line}" for line in changes.math)
        raise ConfigError(
            f"checkpoint {checkpoint} was trained with a config that differs in what is trained:\n{listed}\n"
            f"resuming would continue as neither run; set {OVERRIDE_KEY}=true to resume anyway, or start over "
            f"in a new run.output_dir"
        )
    return changes


def log_resume_changes(changes: ConfigChanges, checkpoint: Path) -> None:
    """Says which changes a resume lets through: those to the math (allowed by the override) loudly."""
    if changes.math:
        logger.warning(
            "resuming %s with changes to what is trained (%s=true): %s",
            checkpoint,
            OVERRIDE_KEY,
            "; ".join(changes.math),
        )
    if changes.harmless:
        logger.info(
            "resuming %s with config changes that keep the training math: %s", checkpoint, "; ".join(changes.harmless)
        )


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET = _Unset()


def _section_or(flat: dict[str, Any], key: str) -> Any:
    """flat[key], or for a key that names an optional section given on this side (model.lora: {r: 8}, flattened
    to model.lora.r), the section as a dict: so a section set on one side and null on the other is a change."""
    if key in flat:
        return flat[key]
    inner = {name.removeprefix(key + "."): value for name, value in flat.items() if name.startswith(key + ".")}
    return inner or _UNSET


def _alters_math(key: str, current: dict[str, Any]) -> bool:
    if key == "train.max_steps":
        return current.get("optim", {}).get("schedule") == "cosine"
    return any(key == math_key or key.startswith(math_key + ".") for math_key in MATH_KEYS)


def _is_factory_argument(key: str) -> bool:
    return ".args." in key
