"""parallel.float8 checked before any process starts: what float8 training needs (torchao, a GPU with
float8 matmuls, bf16 compute for rowwise scaling) and what it does not run beside. Each refusal names the
key and the fix; all of them are reported together."""

from __future__ import annotations

import torch

from paratrain.config.schema import Config
from paratrain.errors import ConfigError
from paratrain.parallel.dims import ParallelDims
from paratrain.parallel.float8 import check_float8_device, require_torchao


def check_float8(config: Config, dims: ParallelDims) -> None:
    """Raises one ConfigError listing every reason parallel.float8 cannot train as configured."""
    if not config.parallel.float8.enabled:
        return
    problems = []
    for check in (
        require_torchao,
        lambda: _check_device(config),
        lambda: _check_rowwise_compute(config, dims),
        lambda: _check_lora(config),
    ):
        try:
            check()
        except ConfigError as error:
            problems.append(str(error))
    if problems:
        raise ConfigError("\n".join(problems))


def _check_device(config: Config) -> None:
    on_gpu = config.train.device == "cuda" or (config.train.device == "auto" and torch.cuda.is_available())
    if on_gpu and not torch.cuda.is_available():
        return  # train.device=cuda without a GPU: the device check reports it
    check_float8_device(
        device_type="cuda" if on_gpu else "cpu",
        capability=torch.cuda.get_device_capability() if on_gpu else None,
        gpu_name=torch.cuda.get_device_name() if on_gpu else None,
        emulate=config.parallel.float8.emulate,
    )


def _check_rowwise_compute(config: Config, dims: ParallelDims) -> None:
    """torch's row-wise scaled matmul writes bf16 only: the compute dtype must be bf16 (emulation aside)."""
    float8, fsdp = config.parallel.float8, config.parallel.fsdp
    bf16 = config.precision == "bf16" or (dims.fsdp_enabled and fsdp.param_dtype == "bf16")
    if float8.scaling == "rowwise" and not (bf16 or float8.emulate):
        raise ConfigError(
            f"parallel.float8.scaling=rowwise needs bf16 compute (torch's row-wise scaled matmul writes bf16 "
            f"only), and this run computes in {config.precision}; set precision=bf16, or "
            f"parallel.float8.scaling=tensorwise"
        )


def _check_lora(config: Config) -> None:
    if config.model.lora is not None:
        raise ConfigError(
            "parallel.float8.enabled=true with model.lora is not supported: peft wraps the Linear layers that "
            "float8 would convert, and its adapters are too narrow for float8 matmuls; set "
            "parallel.float8.enabled=false to train the adapters in bf16 (precision=bf16)"
        )
