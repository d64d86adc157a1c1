"""The training objective checked against the data and the layout before any process starts: DPO needs
preference pairs and preference pairs need DPO, and DPO runs where each rank holds whole sequences and
whole layers (data parallel, sharded or not). Each refusal names the keys and the fix."""

from __future__ import annotations

from paratrain.config.factories import resolve_factory
from paratrain.config.schema import DataConfig, EvalConfig, FactoryConfig
from paratrain.errors import ConfigError
from paratrain.losses import dpo
from paratrain.parallel.dims import ParallelDims

PREFERENCE_DATA = "paratrain.data.preference:preference_data"


def check_objective(loss: FactoryConfig, data: DataConfig, evaluation: EvalConfig, dims: ParallelDims) -> None:
    """Raises ConfigError when the loss and the data do not go together, or DPO meets a layout it cannot run."""
    is_dpo = _resolves_to(loss.factory, dpo, key="loss.factory")
    preference = data.factory == PREFERENCE_DATA
    if preference and not is_dpo:
        raise ConfigError(
            f"data.factory={PREFERENCE_DATA} gives (chosen, rejected) pairs, which only a preference loss reads; "
            f"set loss.factory=paratrain.losses:dpo"
        )
    if is_dpo and not preference:
        raise ConfigError(
            f"loss.factory=paratrain.losses:dpo needs preference pairs: set data.factory={PREFERENCE_DATA} (rows of "
            f"prompt, chosen and rejected)"
        )
    if not is_dpo:
        return
    split = {"parallel.cp": dims.cp, "parallel.tp": dims.tp, "parallel.pp": dims.pp}
    if any(degree > 1 for degree in split.values()):
        keys = ", ".join(f"{key}={degree}" for key, degree in split.items() if degree > 1)
        raise ConfigError(
            f"loss.factory=paratrain.losses:dpo with {keys}: DPO runs where every rank holds whole sequences and "
            f"layers; use ddp, fsdp or hsdp"
        )
    if evaluation.factory is not None:
        raise ConfigError(
            "eval.factory with loss.factory=paratrain.losses:dpo: evaluation on preference pairs is not supported "
            "yet; set eval.factory=null (the log's rewards/accuracies and rewards/margins follow training)"
        )


def _resolves_to(path: str | None, target: object, *, key: str) -> bool:
    if not path:
        return False
    try:
        return resolve_factory(path, key=key) is target
    except ConfigError:  # a factory that does not resolve is reported by its own check
        return False
