"""Model parallel in one process (the classic single-process layout): consecutive parts of the model on different
devices, activations moved from one to the next.

The parts are cut like pipeline stages (``pipeline.split_points``, or balanced by parameters), and
part i goes to ``pipeline.devices[i]``. Only one device computes at a time: this layout exists for
models too large for one device, not for speed (a pipeline overlaps the parts instead).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from paratrain.config.schema import PipelineConfig
from paratrain.errors import ConfigError
from paratrain.models.plan_derivation import plan_of
from paratrain.parallel.pipeline.split import cut_stages
from paratrain.parallel.pipeline.stages import StageModule, stage_modules
from paratrain.tensors import move_to

logger = logging.getLogger("paratrain")


class ModelParallel(nn.Module):
    """Runs the parts in order, each on its device; the output stays on the last part's device."""

    def __init__(self, parts: list[StageModule], devices: list[torch.device]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.devices = devices

    def forward(self, x):
        for part, device in zip(self.parts, self.devices, strict=True):
            x = part(move_to(x, device))
        return x


def model_parallel_devices(options: PipelineConfig) -> list[torch.device]:
    """pipeline.devices, or every visible GPU, or the CPU alone."""
    if options.devices:
        return [parse_device(name) for name in options.devices]
    if torch.cuda.is_available():
        return [torch.device("cuda", index) for index in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


def part_count(options: PipelineConfig, devices: list[torch.device]) -> int:
    """How many parts: one per listed device; else one per split point + 1; else one per device, at least 2."""
    if options.devices:
        return len(options.devices)
    if options.split_points:
        return len(options.split_points) + 1
    return max(2, len(devices))


def apply_model_parallel(model: nn.Module, options: PipelineConfig) -> ModelParallel:
    """Moves each part of the (materialised) model to its device and returns the module that runs them."""
    devices = model_parallel_devices(options)
    parts = cut_stages(model, options, part_count(options, devices))
    placed = [devices[index % len(devices)] for index in range(len(parts))]
    for pieces, device in zip(parts, placed):
        for path in pieces:
            model.get_submodule(path).to(device)
    if len(set(placed)) == 1:
        logger.info("model_parallel: only one device (%s) to use, so all %d parts run there", placed[0], len(parts))
    for index, (pieces, device) in enumerate(zip(parts, placed)):
        logger.info("model_parallel: part %d on %s: %s", index, device, ", ".join(pieces))
    # No autocast per part: the engine's autocast around the whole forward covers every device.
    layer_inputs = plan_of(model).pipeline_layer_inputs
    return ModelParallel(stage_modules(model, parts, contextlib.nullcontext, layer_inputs), placed)


def parse_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"pipeline.devices: {name!r} is not a device; use names like cuda:0, cuda:1 or cpu") from None
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(
            f"pipeline.devices: {name} does not exist here ({torch.cuda.device_count()} GPU(s) visible); "
            f"list devices this machine has, or leave pipeline.devices empty"
        )
    return device
