"""Options a user set that do nothing in the layout or optimizer they chose: worth a warning."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from paratrain.config.schema import Config

if TYPE_CHECKING:  # the CLI imports this module before torch.distributed is needed
    from paratrain.parallel.dims import ParallelDims


def ineffective_options(config: Config, dims: ParallelDims) -> list[str]:
    """One message per explicitly set option that the rest of the config makes irrelevant.

    Args:
        dims: The layout the config resolves to at this world size (``resolve_parallel_dims``).
    """
    warnings = []
    if not dims.ddp_enabled and config.parallel.ddp.model_fields_set:
        keys = ", ".join(f"parallel.ddp.{name}" for name in sorted(config.parallel.ddp.model_fields_set))
        warnings.append(f"{keys} has no effect with the {dims.describe_layout()} layout (ddp only)")
    warnings += _sharding_warnings(config, dims)
    warnings += _checkpointing_warnings(config)
    warnings += _float8_warnings(config, dims)
    warnings += _pipeline_warnings(config, dims)
    optim = config.optim
    if optim.name == "adamw" and "momentum" in optim.model_fields_set:
        warnings.append("optim.momentum has no effect with optim.name=adamw (it is an SGD option)")
    if optim.name == "sgd" and optim.model_fields_set & {"betas", "eps"}:
        warnings.append("optim.betas and optim.eps have no effect with optim.name=sgd (they are AdamW options)")
    if optim.schedule == "constant" and "min_lr_ratio" in optim.model_fields_set:
        warnings.append("optim.min_lr_ratio has no effect with optim.schedule=constant")
    if config.checkpoint.every_steps == 0 and not config.checkpoint.save_final:
        warnings.append("checkpoint.every_steps=0 with checkpoint.save_final=false: this run saves no checkpoint")
    if config.checkpoint.mtbf_hours is not None and config.checkpoint.every_steps != "auto":
        warnings.append("checkpoint.mtbf_hours has no effect unless checkpoint.every_steps=auto")
    return warnings + _eval_and_profile_warnings(config)


def _eval_and_profile_warnings(config: Config) -> list[str]:
    warnings = []
    eval_keys = config.eval.model_fields_set - {"factory"}
    if config.eval.factory is None and eval_keys:
        keys = ", ".join(f"eval.{name}" for name in sorted(eval_keys))
        warnings.append(f"{keys} has no effect without eval.factory (Python API: Trainer(eval_dataset=...))")
    profile_keys = config.profile.model_fields_set - {"enabled"}
    if not config.profile.enabled and profile_keys:
        keys = ", ".join(f"profile.{name}" for name in sorted(profile_keys))
        warnings.append(f"{keys} has no effect without profile.enabled=true")
    return warnings


def _checkpointing_warnings(config: Config) -> list[str]:
    parallel = config.parallel
    if parallel.activation_checkpointing == "none" and "activation_checkpointing_every" in parallel.model_fields_set:
        return ["parallel.activation_checkpointing_every has no effect with parallel.activation_checkpointing=none"]
    return []


def _float8_warnings(config: Config, dims: ParallelDims) -> list[str]:
    float8 = config.parallel.float8
    if not float8.enabled:
        if float8.model_fields_set:
            keys = ", ".join(f"parallel.float8.{name}" for name in sorted(float8.model_fields_set))
            return [f"{keys} has no effect without parallel.float8.enabled=true"]
        return []
    warnings = []
    gather_set = "fsdp_float8_all_gather" in float8.model_fields_set and float8.fsdp_float8_all_gather
    if gather_set and (float8.scaling != "tensorwise" or not dims.fsdp_enabled or dims.tp_enabled):
        warnings.append(
            f"parallel.float8.fsdp_float8_all_gather has no effect with scaling={float8.scaling} and the "
            f"{dims.describe_layout()} layout (tensorwise scaling under fsdp or hsdp, without tp, only)"
        )
    if not (config.parallel.compile or float8.emulate):
        warnings.append(
            "parallel.float8 without parallel.compile: each float8 cast and scale runs as kernels of its own, "
            "which usually leaves float8 slower than bf16; set parallel.compile=true"
        )
    return warnings


def _sharding_warnings(config: Config, dims: ParallelDims) -> list[str]:
    parallel, warnings = config.parallel, []
    sharded = dims.fsdp_enabled
    if not sharded and parallel.fsdp.model_fields_set:  # all fsdp options, grad_sync included, are fsdp-only
        keys = ", ".join(f"parallel.fsdp.{name}" for name in sorted(parallel.fsdp.model_fields_set))
        warnings.append(f"{keys} has no effect with the {dims.describe_layout()} layout (fsdp and hsdp only)")
    if parallel.sequence_parallel and not dims.tp_enabled:
        warnings.append("parallel.sequence_parallel has no effect without tensor parallel (parallel.tp > 1)")
    if sharded and parallel.fsdp.cpu_offload and config.train.device != "cuda" and not torch.cuda.is_available():
        warnings.append("parallel.fsdp.cpu_offload has no effect when training on the CPU already")
    return warnings


def _pipeline_warnings(config: Config, dims: ParallelDims) -> list[str]:
    pipeline = config.pipeline
    pipelined = dims.pp_enabled
    set_keys = pipeline.model_fields_set
    if not pipelined and not dims.model_parallel_enabled and set_keys:
        keys = ", ".join(f"pipeline.{name}" for name in sorted(set_keys))
        return [f"{keys} has no effect without a pipeline (parallel.pp > 1, or parallel.strategy=model_parallel)"]
    if dims.model_parallel_enabled and set_keys - {"split_points", "balance", "devices"}:
        keys = ", ".join(f"pipeline.{name}" for name in sorted(set_keys - {"split_points", "balance", "devices"}))
        return [f"{keys} has no effect with parallel.strategy=model_parallel (it runs one part at a time, no schedule)"]
    if pipelined and "devices" in set_keys:
        return [
            "pipeline.devices has no effect with parallel.pp (each rank uses its own device); it is for model_parallel"
        ]
    if pipelined and pipeline.microbatches and "micro_batch_size" in config.train.model_fields_set:
        return ["train.micro_batch_size has no effect: pipeline.microbatches sets the micro-batch size"]
    return []
