"""Process-wide kernel settings a run applies once its device is known.

Fast where it is safe: on CUDA, fp32 matmuls use TF32 tensor cores (about 7x an H100's plain fp32
rate; torch leaves it off). ``train.deterministic`` trades speed for bit-exact repeats on a GPU:
flash and memory-efficient attention backwards are non-deterministic, and cuBLAS needs a fixed
workspace to be deterministic.
"""

from __future__ import annotations

import os

import torch

# cuBLAS's documented setting for deterministic results (CUDA >= 10.2); read when cuBLAS initialises.
CUBLAS_WORKSPACE = ":4096:8"


def apply_kernel_settings(device: torch.device, *, deterministic: bool) -> None:
    """TF32 matmuls on CUDA; deterministic algorithms and math-only attention when asked for."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if deterministic:
        apply_deterministic()


def apply_deterministic() -> None:
    """Deterministic kernels everywhere (an op without one raises rather than silently varying)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    # SDPA would pick flash or memory-efficient kernels, whose backward accumulates in varying order.
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_math_sdp(True)
