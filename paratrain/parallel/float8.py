"""float8 training through torchao: the Linear layers of the model's blocks swapped for torchao's
``Float8Linear`` (``convert_to_float8_training``), first of the layout's transforms, so tensor parallel,
checkpointing, compile and FSDP all wrap the float8 layers (torchtitan converts before parallelizing too).

torchao is the optional extra ``paratrain[float8]``: it is imported only by a run that turns float8 on,
and what the checks before launch need of it (installed? which release?) is read from its metadata.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import logging

from torch import nn

from paratrain.config.schema import Float8Config
from paratrain.errors import ConfigError
from paratrain.models.hf import supported_range
from paratrain.models.plan_derivation import ParallelPlan

logger = logging.getLogger("paratrain")

INSTALL_HINT = "pip install 'paratrain[float8]'"
# float8 tensor cores: Ada (8.9) and Hopper (9.0) onwards; torch._scaled_mm refuses older GPUs.
MIN_CAPABILITY = (8, 9)
# float8 matmuls need both sizes of the weight to be multiples of 16 (16-byte aligned rows of 1-byte elements).
FLOAT8_ALIGNMENT = 16


def float8_linear_paths(model: nn.Module, plan: ParallelPlan) -> list[str]:
    """The Linear layers float8 converts, by module path: inside the plan's blocks, the ones the block's
    tensor-parallel plan names (the attention and MLP projections: the step's large matmuls; a router's
    few outputs stay precise), or every Linear when the plan names none; each with in and out features
    that are multiples of 16. The embedding and the output head stay in the compute dtype, as torchtitan
    keeps its output layer, since the loss reads the head's logits directly."""
    paths = []
    for block in plan.blocks:
        named = model.get_submodule(block).named_modules()
        layers = {name: module for name, module in named if isinstance(module, nn.Linear)}
        chosen = [name for name in layers if name in plan.block_tp_plan] if plan.block_tp_plan else list(layers)
        paths += [f"{block}.{name}" for name in chosen if _aligned(layers[name])]
    return paths


def _aligned(layer: nn.Linear) -> bool:
    return layer.in_features % FLOAT8_ALIGNMENT == 0 and layer.out_features % FLOAT8_ALIGNMENT == 0


def apply_float8_training(
    model: nn.Module, *, plan: ParallelPlan, options: Float8Config, fsdp: bool, tp: int = 1, compile: bool = False
) -> None:
    """Swaps the layers of ``float8_linear_paths`` for torchao's Float8Linear in place (parameter names
    unchanged, so checkpoints move between float8 and bf16 runs).

    Args:
        fsdp: The layout shards with FSDP, and ``tp`` is its tensor-parallel degree: they decide
            whether the weights are gathered in float8 (``gathers_in_float8``).
        compile: The blocks will be compiled (rowwise needs an inductor setting then).
    """
    require_torchao()
    # lazy: torchao is an optional extra, loaded only by runs that turn float8 on
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    paths = set(float8_linear_paths(model, plan))
    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(options.scaling),
        enable_fsdp_float8_all_gather=gathers_in_float8(options, fsdp=fsdp, tp=tp),
        emulate=options.emulate,
    )
    if options.scaling == "rowwise" and compile:
        # Inductor otherwise fuses the rowwise casts with a rounding eager does not, and the scales differ
        # from eager's (pytorch#150859; torchtitan sets the same).
        import torch._inductor.config  # lazy: inductor loads only for compiled rowwise runs

        torch._inductor.config.emulate_precision_casts = True
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, path: path in paths)
    logger.info(
        "float8 (%s scaling%s) on %d Linear layers of %d blocks%s",
        options.scaling,
        ", weights all-gathered in float8" if config.enable_fsdp_float8_all_gather else "",
        len(paths),
        len(plan.blocks),
        ", emulated" if options.emulate else "",
    )


def gathers_in_float8(options: Float8Config, *, fsdp: bool, tp: int = 1) -> bool:
    """FSDP all-gathers the converted weights already cast to float8: tensorwise scaling only (a rowwise
    weight has a scale per row, which torchao does not gather), where FSDP shards, and without tensor
    parallel. Beside tp, torchao computes each weight's scale over the FSDP ranks alone, so every
    tensor-parallel shard would get a scale of its own: the numbers would then change with the tp degree
    (2e-4 of the loss on the CPU parity run), where a scale over the whole weight keeps them those of one
    process. torchao's precompute_float8_dynamic_scale_for_fsdp, called after each optimizer step, would
    give whole-weight scales; paratrain does not call it yet."""
    return options.enabled and fsdp and tp == 1 and options.scaling == "tensorwise" and options.fsdp_float8_all_gather


def require_torchao() -> None:
    """Raises a ConfigError unless a supported torchao release is installed, naming the command that
    installs one. Reads the metadata only: importing torchao takes seconds the checks before launch
    need not spend."""
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            f"parallel.float8.enabled=true trains through torchao, which is not installed: {INSTALL_HINT}"
        )
    # lazy: packaging comes with tensorboard, a dependency; read only when float8 is on
    from packaging.specifiers import SpecifierSet

    installed, supported = importlib.metadata.version("torchao"), supported_range("torchao")
    if supported and installed not in SpecifierSet(supported):
        raise ConfigError(
            f"parallel.float8.enabled=true: torchao {installed} is installed, but paratrain supports "
            f"torchao{supported} (the releases its tests run): {INSTALL_HINT}"
        )


def check_float8_device(
    *, device_type: str, capability: tuple[int, int] | None, gpu_name: str | None, emulate: bool
) -> None:
    """Raises a ConfigError when float8 matmuls cannot run where this run trains: on the CPU, or on a GPU
    below compute capability 8.9. ``emulate`` runs anywhere (at no speed-up).

    Args:
        device_type: "cpu" or "cuda": where the run trains.
        capability: The GPU's (major, minor) compute capability; None on the CPU.
        gpu_name: The GPU's name, for the message.
    """
    if emulate:
        return
    needed = f"a CUDA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (H100, H200, L4, L40S, RTX 4090)"
    fixes = (
        "set parallel.float8.enabled=false, or parallel.float8.emulate=true to check the layout without the speed-up"
    )
    if device_type != "cuda" or capability is None:
        raise ConfigError(f"parallel.float8.enabled=true needs {needed}, and this run trains on the CPU; {fixes}")
    if capability < MIN_CAPABILITY:
        raise ConfigError(
            f"parallel.float8.enabled=true needs {needed}, and this run's GPU, {gpu_name}, has compute capability "
            f"{capability[0]}.{capability[1]}; {fixes}"
        )
