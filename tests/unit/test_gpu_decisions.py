"""Decisions the CUDA paths make, tested on CPU: which backend, dtype and kernel flags a run gets."""

from __future__ import annotations

import os

import pytest
import torch

from paratrain.checkpoint.writer import staging_pins_memory
from paratrain.checks.preflight import _dims, check_compile
from paratrain.config.loading import load_config
from paratrain.config.schema import FSDPConfig, OptimConfig, PipelineConfig
from paratrain.cuda_settings import apply_kernel_settings
from paratrain.errors import ConfigError
from paratrain.launch.process_group import process_group_backend
from paratrain.layout.pipelined import records_timeline
from paratrain.optim import build_optimizer, use_fused_kernel
from paratrain.parallel.devices import devices_computed_on
from paratrain.parallel.dims import ParallelDims
from paratrain.parallel.fsdp import _mixed_precision, resolved_reduce_dtype
from paratrain.parallel.model_parallel import ModelParallel
from paratrain.tensors import output_device


def test_cpu_offload_on_cuda_gets_gloo_beside_nccl_for_collectives_on_cpu_gradients():
    cuda = torch.device("cuda", 1)
    assert process_group_backend(cuda, cpu_collectives=True) == "cuda:nccl,cpu:gloo"
    assert process_group_backend(cuda, cpu_collectives=False) == "nccl"
    assert process_group_backend(torch.device("cpu"), cpu_collectives=True) == "gloo"
    assert process_group_backend(torch.device("cpu"), cpu_collectives=False) == "gloo"


def test_fsdp_reduces_in_fp32_unless_told_otherwise():
    assert resolved_reduce_dtype(FSDPConfig(param_dtype="bf16")) == "fp32"
    assert resolved_reduce_dtype(FSDPConfig(param_dtype="fp16")) == "fp32"
    assert resolved_reduce_dtype(FSDPConfig(param_dtype="bf16", reduce_dtype="bf16")) == "bf16"
    assert resolved_reduce_dtype(FSDPConfig()) is None
    policy = _mixed_precision(FSDPConfig(param_dtype="bf16"))
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_the_optimizer_is_fused_on_cuda_or_cpu_for_parameters_of_one_kind_unless_the_config_says_otherwise():
    assert use_fused_kernel({"cuda"}, uniform=True) is True
    assert use_fused_kernel({"cuda"}, uniform=False) is False  # tensor parallel alone: sharded beside plain
    assert use_fused_kernel({"cpu"}, uniform=True) is True
    assert use_fused_kernel({"cpu"}, uniform=False) is False
    assert use_fused_kernel({"cuda", "cpu"}, uniform=True) is False  # one kernel runs on one kind of device
    assert use_fused_kernel({"meta"}, uniform=True) is False
    assert use_fused_kernel({"cpu"}, uniform=True, setting="off") is False
    assert use_fused_kernel({"cuda"}, uniform=True, setting="off") is False
    with pytest.raises(ConfigError, match="optim.fused=on.*set optim.fused=auto"):
        use_fused_kernel({"cuda"}, uniform=False, setting="on")
    optimizer = build_optimizer(torch.nn.Linear(2, 2), OptimConfig(), dp_size=1)
    assert optimizer.defaults["fused"] is True
    optimizer = build_optimizer(torch.nn.Linear(2, 2), OptimConfig(fused="off"), dp_size=1)
    assert optimizer.defaults["fused"] is None and optimizer.defaults["foreach"] is True
    for name in ("adamw", "sgd"):  # both skip a non-finite step on the device when fused
        optimizer = build_optimizer(torch.nn.Linear(2, 2), OptimConfig(name=name, fused="on"), dp_size=1)
        assert optimizer.defaults["fused"] is True and optimizer._step_supports_amp_scaling


def test_async_staging_pins_host_memory_only_for_a_run_on_a_gpu():
    assert staging_pins_memory(torch.device("cuda", 3)) is True
    assert staging_pins_memory(torch.device("cpu")) is False


def test_cuda_runs_get_tf32_and_deterministic_runs_get_deterministic_kernels(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.cuda.mem_efficient_sdp_enabled(),
        torch.backends.cuda.cudnn_sdp_enabled(),
    )
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        apply_kernel_settings(torch.device("cpu"), deterministic=False)
        assert torch.backends.cuda.matmul.allow_tf32 is False
        assert torch.are_deterministic_algorithms_enabled() is saved[1]
        apply_kernel_settings(torch.device("cuda", 0), deterministic=True)
        assert torch.backends.cuda.matmul.allow_tf32 is True
        assert torch.are_deterministic_algorithms_enabled() is True
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert not torch.backends.cuda.flash_sdp_enabled()
        assert not torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.use_deterministic_algorithms(saved[1])
        torch.backends.cuda.enable_flash_sdp(saved[2])
        torch.backends.cuda.enable_mem_efficient_sdp(saved[3])
        torch.backends.cuda.enable_cudnn_sdp(saved[4])


def test_pipeline_timeline_is_recorded_by_default_only_off_the_gpu():
    assert records_timeline(PipelineConfig(), torch.device("cpu")) is True
    assert records_timeline(PipelineConfig(), torch.device("cuda", 0)) is False
    assert records_timeline(PipelineConfig(record_timeline=True), torch.device("cuda", 0)) is True
    assert records_timeline(PipelineConfig(record_timeline=False), torch.device("cpu")) is False


def test_targets_follow_the_outputs_device_for_model_parallel_losses():
    logits = torch.empty(2, 3, device="meta")
    assert output_device({"logits": logits}, default=torch.device("cpu")) == torch.device("meta")
    assert output_device((logits,), default=torch.device("cpu")) == torch.device("meta")
    assert output_device(None, default=torch.device("cpu")) == torch.device("cpu")


def test_compile_with_single_process_data_parallel_is_refused_naming_the_keys():
    config = load_config(None, ["parallel.strategy=dp", "parallel.compile=true"])
    with pytest.raises(ConfigError, match="parallel.compile=true .* parallel.strategy=dp"):
        check_compile(config, _dims(config, 1, 1))
    ddp = load_config(None, ["parallel.strategy=ddp", "parallel.compile=true"])
    check_compile(ddp, _dims(ddp, 2, 2))


def test_model_parallel_is_built_in_host_memory_before_its_parts_move_to_their_devices():
    from paratrain.layout.flat import build_device

    gpu = torch.device("cuda", 0)
    assert build_device(ParallelDims.resolve("model_parallel", world_size=1), gpu) == torch.device("cpu")
    assert build_device(ParallelDims.resolve("single", world_size=1), gpu) == gpu


def test_the_loss_is_compiled_with_the_blocks_and_computes_the_same_value():
    from paratrain.losses import cross_entropy
    from paratrain.parallel.activation import compile_loss

    loss = cross_entropy()
    assert compile_loss(loss, compile=False) is loss
    compiled = compile_loss(loss, compile=True, backend="aot_eager")
    assert compiled is not loss and compiled._torchdynamo_orig_callable is loss
    logits, targets = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    torch.testing.assert_close(compiled(logits, targets), loss(logits, targets))


def test_a_process_driving_several_gpus_monitors_and_checkpoints_each_of_them():
    gpus = [torch.device("cuda", index) for index in range(3)]
    parts = ModelParallel([torch.nn.Identity() for _ in range(4)], [gpus[0], gpus[1], gpus[2], gpus[1]])
    assert devices_computed_on(parts, own=gpus[0]) == gpus
    assert devices_computed_on(torch.nn.Linear(2, 2), own=gpus[1]) == [gpus[1]]
    cpu = torch.device("cpu")
    assert devices_computed_on(torch.nn.DataParallel(torch.nn.Linear(2, 2)), own=cpu) == [cpu]  # no GPU: no replicas
