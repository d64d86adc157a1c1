"""Decisions the CUDA paths make, tested on CPU: which backend, dtype and kernel flags a run gets."""

from __future__ import annotations

import torch

from paratrain.config.schema import FSDPConfig
from paratrain.launch.process_group import process_group_backend
from paratrain.parallel.fsdp import _mixed_precision, resolved_reduce_dtype


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
