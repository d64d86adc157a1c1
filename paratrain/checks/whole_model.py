"""Features that hold the whole model in one process, checked against the model's size before any process
starts: each is refused, naming why and what to use instead, above the size where it would undo what
sharding saves."""

from __future__ import annotations

from torch import nn

from paratrain.config.schema import DebugConfig, PipelineConfig
from paratrain.errors import ConfigError

# debug.dump_initial_weights gathers every weight to rank 0 to write one file: for comparing small models.
DUMP_LIMIT_BYTES = 2 << 30
# pipeline.balance=time times every piece on a whole copy of the model on rank 0's device.
TIMING_LIMIT_BYTES = 8 << 30


def check_whole_model_features(debug: DebugConfig, pipeline: PipelineConfig, model: nn.Module) -> None:
    """Raises ConfigError when ``model`` (on meta) is too large for a feature that holds it whole on rank 0."""
    size = sum(param.numel() * param.element_size() for param in model.parameters())
    if debug.dump_initial_weights and size > DUMP_LIMIT_BYTES:
        raise ConfigError(
            f"debug.dump_initial_weights=true gathers every weight to rank 0 ({_gib(size)} for this model, over "
            f"{_gib(DUMP_LIMIT_BYTES)}): it is for comparing small models' initial weights; turn it off, or "
            f"compare the first checkpoints with `paratrain export`"
        )
    if pipeline.balance == "time" and size > TIMING_LIMIT_BYTES:
        raise ConfigError(
            f"pipeline.balance=time times each piece on a whole copy of the model on rank 0 ({_gib(size)} for this "
            f"model, over {_gib(TIMING_LIMIT_BYTES)}); use pipeline.balance=parameters, or split_points"
        )


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"
