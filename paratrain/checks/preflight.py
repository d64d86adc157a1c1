"""Checks that run before any process starts training, so bad input fails fast and leaves
``output_dir`` untouched. Every problem found is reported at once."""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from paratrain.callbacks.configured import check_callback_configs
from paratrain.checkpoint import find_checkpoints
from paratrain.checkpoint.config_changes import check_resume_config
from paratrain.checkpoint.manifest import check_checkpoint, is_complete, read_manifest
from paratrain.checks.experts import check_expert_layout
from paratrain.checks.float8_settings import check_float8
from paratrain.checks.objectives import check_objective
from paratrain.checks.pipeline_settings import check_pipeline
from paratrain.checks.sequence_settings import check_sequence_layout
from paratrain.checks.whole_model import check_whole_model_features
from paratrain.config.factories import call_factory, check_factory_args
from paratrain.config.schema import Config
from paratrain.data.model_fit import check_data_fits_model
from paratrain.errors import CheckpointError, ConfigError
from paratrain.evaluation import check_evaluation
from paratrain.models.hf import is_transformers_model
from paratrain.models.lora import maybe_apply_lora
from paratrain.models.meta import on_meta
from paratrain.models.plan_derivation import plan_of
from paratrain.optim import check_fused_setting
from paratrain.parallel.dims import ParallelDims, resolve_parallel_dims
from paratrain.tracking.readiness import check_trackers_ready

# Set by the CLI once it has run the checks, so workers it launches do not repeat them.
PREFLIGHT_DONE_ENV = "PARATRAIN_PREFLIGHT_DONE"


def preflight(config: Config, *, world_size: int, nproc_per_node: int) -> None:
    """Raises one ConfigError listing every problem with running ``config`` on this many processes."""
    # Several checks read the model, built on meta once (a failing factory is reported by check_factory_args).
    model_on_meta = functools.cache(lambda: _model_on_meta(config))
    checks: list[Callable[[], None]] = [
        lambda: _check_layout(config, world_size, nproc_per_node, model_on_meta),
        lambda: _check_precision(config, _dims(config, world_size, nproc_per_node)),
        lambda: check_float8(config, _dims(config, world_size, nproc_per_node)),
        lambda: _check_fused_optimizer(config, _dims(config, world_size, nproc_per_node)),
        lambda: check_compile(config, _dims(config, world_size, nproc_per_node)),
        lambda: check_pipeline(config, _dims(config, world_size, nproc_per_node)),
        lambda: _check_devices(config, nproc_per_node),
        lambda: check_factory_args(config.model, key="model"),
        lambda: _check_pretrained(config.model.pretrained),
        lambda: check_factory_args(config.data, key="data"),
        lambda: _check_data_fits_model(config, model_on_meta),
        lambda: _check_sequence_layout(config, _dims(config, world_size, nproc_per_node), model_on_meta),
        lambda: _check_expert_layout(config, _dims(config, world_size, nproc_per_node), model_on_meta),
        lambda: _check_final_hf_export(config, model_on_meta),
        lambda: check_whole_model_features(config.debug, config.pipeline, model_on_meta()),
        lambda: check_objective(config.loss, config.data, config.eval, _dims(config, world_size, nproc_per_node)),
        lambda: _check_lora_layout(config, _dims(config, world_size, nproc_per_node)),
        lambda: check_factory_args(config.loss, key="loss"),
        lambda: check_callback_configs(config.callbacks),
        lambda: _check_evaluation(config, _dims(config, world_size, nproc_per_node)),
        lambda: check_trackers_ready(config.log.tracker_names(), output_dir=config.run.output_dir),
        lambda: _check_writable(config.run.output_dir),
        lambda: _check_resume(config),
        lambda: _check_resume_config(config),
    ]
    problems = []
    for check in checks:
        try:
            check()
        except (ConfigError, CheckpointError) as error:
            if str(error) not in problems:  # checks that share a cause report it once
                problems.append(str(error))
    if problems:
        raise ConfigError("\n".join(problems))


def _check_pretrained(pretrained: str | None) -> None:
    if pretrained:
        # lazy: safetensors and DTensor only for the runs that use them, to keep the launcher's checks fast
        from paratrain.models.pretrained import check_pretrained_dir

        check_pretrained_dir(Path(pretrained))


def _dims(config: Config, world_size: int, nproc_per_node: int) -> ParallelDims:
    return resolve_parallel_dims(config.parallel, world_size=world_size, local_world_size=nproc_per_node)


def _check_layout(config: Config, world_size: int, nproc_per_node: int, model_on_meta: Callable[[], nn.Module]) -> None:
    dims = _dims(config, world_size, nproc_per_node)
    step_unit = config.train.micro_batch_size * dims.dp
    if config.train.global_batch_size % step_unit:
        raise ConfigError(
            f"train.global_batch_size={config.train.global_batch_size} is not divisible by "
            f"train.micro_batch_size={config.train.micro_batch_size} x data-parallel size {dims.dp}; "
            f"use a multiple of {step_unit}"
        )
    if dims.tp > 1:
        # lazy: loaded only for the runs that use it (safetensors, DTensor) to keep the launcher's checks fast
        from paratrain.parallel.tensor import check_tensor_parallel_plan  # loads DTensor: only when used

        plan = plan_of(model_on_meta())
        check_tensor_parallel_plan(plan, dims.tp, sequence_parallel=config.parallel.sequence_parallel)


def _model_on_meta(config: Config) -> nn.Module:
    """The config's model, built without memory, to read its parallel plan."""
    with on_meta():
        return maybe_apply_lora(call_factory(config.model, key="model"), config.model.lora)


def _check_lora_layout(config: Config, dims: ParallelDims) -> None:
    """LoRA adapters run where each rank holds whole layers (data parallel, sharded or not)."""
    if config.model.lora is None:
        return
    if dims.tp > 1 or dims.pp > 1:
        raise ConfigError(
            f"model.lora with parallel.tp={dims.tp} and parallel.pp={dims.pp}: peft replaces each adapted Linear "
            f"with a wrapper that the tensor-parallel plan (which names the Linear itself) and the pipeline split "
            f"do not know; use ddp, fsdp or hsdp (LoRA's frozen base needs little memory sharded by fsdp)"
        )
    if config.model.lora.target_parameters and dims.ep_enabled:
        raise ConfigError(
            f"model.lora.target_parameters={config.model.lora.target_parameters} with parallel.ep={dims.ep}: each "
            f"rank holds 1/{dims.ep} of the experts, and peft's adapter on a stacked expert weight holds every "
            f"expert's; drop parallel.ep (fsdp shards the frozen experts), or adapt attention only (target_modules)"
        )


def _check_final_hf_export(config: Config, model_on_meta: Callable[[], nn.Module]) -> None:
    if not config.checkpoint.save_final_hf:
        return
    if not config.checkpoint.save_final:
        raise ConfigError(
            "checkpoint.save_final_hf=true exports the run's last checkpoint, and checkpoint.save_final=false "
            "writes none; set checkpoint.save_final=true"
        )
    model = _built_or_none(model_on_meta)
    if model is None:
        return
    if not is_transformers_model(model):
        raise ConfigError(
            f"checkpoint.save_final_hf=true: {type(model).__name__} from model.factory={config.model.factory!r} is "
            f"not a transformers model, so it has no Hugging Face format; set checkpoint.save_final_hf=false and "
            f"use `paratrain export CKPT --out FILE.safetensors`"
        )


def _check_data_fits_model(config: Config, model_on_meta: Callable[[], nn.Module]) -> None:
    model = _built_or_none(model_on_meta)
    if model is None:
        return
    check_data_fits_model(config.data.args, model, key="data")
    if config.eval.factory is not None:
        check_data_fits_model(config.eval.args, model, key="eval")


def _check_sequence_layout(config: Config, dims: ParallelDims, model_on_meta: Callable[[], nn.Module]) -> None:
    model = _built_or_none(model_on_meta)
    if model is not None:
        check_sequence_layout(config.parallel, config.data, dims, model=model)


def _check_expert_layout(config: Config, dims: ParallelDims, model_on_meta: Callable[[], nn.Module]) -> None:
    model = _built_or_none(model_on_meta) if dims.ep_enabled else None
    if model is not None:
        check_expert_layout(dims, model=model)


def _built_or_none(model_on_meta: Callable[[], nn.Module]) -> nn.Module | None:
    """The model on meta, or None when it does not build: the model factory's own check reports that.
    The factory's own ConfigError (its model.args, a transformers release out of range) is raised: it
    is the refusal to report."""
    try:
        return model_on_meta()
    except ConfigError:
        raise
    except Exception:
        return None


def _check_fused_optimizer(config: Config, dims: ParallelDims) -> None:
    # Tensor parallel alone is the one layout whose parameters are of mixed kinds (see build_optimizer).
    check_fused_setting(config.optim.fused, uniform=not (dims.tp_enabled and not dims.fsdp_enabled))


def _check_precision(config: Config, dims: ParallelDims) -> None:
    fsdp = config.parallel.fsdp
    if config.precision == "fp16" and dims.tp_enabled and not dims.fsdp_enabled:
        # Tensor parallel alone leaves embeddings and norms unsharded beside sharded linears, and the
        # gradient scaler's unscale kernel refuses that mix; under fsdp every parameter is sharded.
        raise ConfigError(
            "precision=fp16 with tensor parallel alone is not supported: the gradient scaler cannot unscale "
            "a mix of sharded and unsharded gradients; use precision=bf16, or add data-parallel shards (parallel.dp_shard) beside parallel.tp"
        )
    if config.precision == "fp16" and fsdp.cpu_offload and dims.fsdp_enabled:
        raise ConfigError(
            "precision=fp16 with parallel.fsdp.cpu_offload=true is not supported: the gradient scaler "
            "cannot unscale gradients offloaded to the CPU; use precision=bf16, or cpu_offload=false"
        )


def _check_evaluation(config: Config, dims: ParallelDims) -> None:
    # From the command line there is no other way to give an evaluation dataset than eval.factory.
    if config.eval.every_steps and config.eval.factory is None:
        raise ConfigError(
            f"eval.every_steps={config.eval.every_steps} asks for evaluation, but eval.factory is null; "
            f"set eval.factory to a validation dataset factory, or remove eval.every_steps"
        )
    check_evaluation(config.eval, dims)
    if config.eval.factory is not None:
        check_factory_args(config.eval, key="eval")


def check_compile(config: Config, dims: ParallelDims) -> None:
    """torch.compile binds the compiled forward to the original module, so nn.DataParallel's
    replicas would run the first GPU's weights on their inputs: refused rather than wrong."""
    if config.parallel.compile and dims.dataparallel_enabled:
        raise ConfigError(
            "parallel.compile=true is not supported with parallel.strategy=dp (nn.DataParallel's replicas "
            "would run the compiled module of the first GPU); use strategy=ddp with one process per GPU, "
            "or parallel.compile=false"
        )


def _check_devices(config: Config, nproc_per_node: int) -> None:
    on_cpu = config.train.device == "cpu" or (config.train.device == "auto" and not torch.cuda.is_available())
    if on_cpu and config.parallel.fsdp.cpu_offload:
        # FSDP would move each unit's parameters to the accelerator for compute and fail mid-build.
        raise ConfigError(
            "parallel.fsdp.cpu_offload=true offloads from a GPU to host memory, but this run trains on the CPU, "
            "where parameters already live in host memory; remove parallel.fsdp.cpu_offload or use train.device=cuda"
        )
    if config.train.device != "cuda":
        return
    available = torch.cuda.device_count()
    if available < nproc_per_node:
        raise ConfigError(
            f"train.device=cuda with {nproc_per_node} process(es) per node needs {nproc_per_node} GPU(s), "
            f"but this machine has {available}; use train.device=cpu or fewer processes per node"
        )


def _check_writable(output_dir: Path) -> None:
    existing = output_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            f"run.output_dir={output_dir}: {existing} is a file, not a directory; choose another output_dir"
        )
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise ConfigError(
            f"run.output_dir={output_dir} is not writable ({error.strerror} in {existing}); choose a writable directory"
        ) from None


def _check_resume(config: Config) -> None:
    resume = config.checkpoint.resume
    if resume == "auto":
        return
    if resume == "never":
        if find_checkpoints(config.run.output_dir / "checkpoints"):
            raise ConfigError(
                f"checkpoint.resume=never but {config.run.output_dir}/checkpoints already holds checkpoints; "
                f"use checkpoint.resume=auto to continue, or a new run.output_dir to start over"
            )
        return
    if not Path(resume).exists():
        raise ConfigError(
            f"checkpoint.resume={resume}: no such checkpoint; use auto, never, or an existing step-<N> directory"
        )
    try:
        # What needs no reading of the data: each file's checksum is checked as the resume loads it.
        check_checkpoint(Path(resume))
    except CheckpointError as error:
        raise ConfigError(f"checkpoint.resume={resume}: {error}") from None


def _check_resume_config(config: Config) -> None:
    """Refuses to resume a checkpoint trained with a config that changes what is trained.

    For ``auto``: the newest complete checkpoint's manifest, unverified; the trainer checks the one it loads.
    """
    resume = config.checkpoint.resume
    if resume == "auto":
        complete = [path for _, path in find_checkpoints(config.run.output_dir / "checkpoints") if is_complete(path)]
        checkpoint = complete[-1] if complete else None
    else:
        checkpoint = Path(resume) if resume != "never" and is_complete(Path(resume)) else None
    if checkpoint is None:
        return  # nothing to resume, or _check_resume says why not
    check_resume_config(
        read_manifest(checkpoint).get("config", {}),
        config.model_dump(mode="json"),
        checkpoint=checkpoint,
        allow_change=config.checkpoint.allow_config_change,
    )
