"""ThroughputMonitor: achieved model FLOP/s and model FLOPs utilisation (MFU) on log steps.

Model FLOPs per sample, in order of preference:

1. the monitor's ``flops_per_sample`` argument;
2. the model's ``flops_per_sample()`` method, or ``flops_per_token(seq_len)`` times the tokens per sample
   (the built-in GPT gives 6·N + 12·L·d·S per token: N non-embedding parameters, L layers, width d,
   sequence length S, as in the PaLM paper's appendix B);
3. 6·N per token (2·N multiply-adds forward, twice that backward), N every parameter; a sample of
   non-token inputs counts as one token.

Fields added to the metrics record: ``flops_per_s`` (whole job: FLOPs per sample x samples/s),
``flops_per_s_per_device`` (divided by the number of processes, or of GPUs for DataParallel) and, where the peak is known, ``mfu``
(per-device FLOP/s over the device's dense peak for the run's compute dtype, from ``PEAK_FLOPS``). On
CPU, or on a GPU not in the table, MFU is unavailable unless ``peak_flops_per_device`` is given; the
log says so once.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from paratrain.callbacks.base import Callback, CallbackContext
from paratrain.config.schema import FSDPConfig
from paratrain.models.contract import CountsFlopsPerSample, CountsFlopsPerToken
from paratrain.parallel.collectives import all_reduce_sum
from paratrain.parallel.dims import ParallelDims

logger = logging.getLogger("paratrain")

# Dense (no sparsity) peak FLOP/s from NVIDIA's data sheets, by a name fragment of
# torch.cuda.get_device_name, first match wins. fp32 is the plain FP32 rate: PyTorch only uses TF32 for
# matmuls when torch.backends.cuda.matmul.allow_tf32 is set (then the tf32 rate applies).
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12}),
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    ("H100 NVL", {"bf16": 835e12, "fp16": 835e12, "tf32": 417e12, "fp32": 60e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12}),  # SXM
    ("A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
]


class ThroughputMonitor(Callback):
    """Adds achieved FLOP/s and MFU to every logged step. Config:
    ``callbacks: [{factory: paratrain.callbacks.throughput:ThroughputMonitor, args: {...}}]``.

    Args:
        flops_per_sample: Model FLOPs (forward and backward) of one sample; None: from the model.
        peak_flops_per_device: Peak FLOP/s of one device; None: from PEAK_FLOPS by device name and dtype.
    """

    def __init__(self, *, flops_per_sample: float | None = None, peak_flops_per_device: float | None = None):
        self.flops_per_sample = flops_per_sample
        self.peak_flops_per_device = peak_flops_per_device
        self.num_devices = 1  # set at train start

    def on_train_start(self, context: CallbackContext) -> None:
        trainer = context.trainer
        if self.flops_per_sample is None:
            pipeline_group = trainer.dims.pp_mesh.get_group() if trainer.dims.pp_enabled else None
            self.flops_per_sample = model_flops_per_sample(
                trainer.bare_model,
                tokens_per_sample=trainer.tokens_per_sample,
                pipeline_group=pipeline_group,
                device=trainer.ctx.device,
            )
        if self.peak_flops_per_device is None:
            self.peak_flops_per_device = peak_flops(
                trainer.ctx.device, compute_dtype(trainer.config.precision, trainer.config.parallel.fsdp, trainer.dims)
            )
        # One device per process, except DataParallel, whose one process drives every visible GPU.
        gpus_per_process = torch.cuda.device_count() if trainer.dims.dataparallel_enabled else 1
        self.num_devices = trainer.ctx.world_size * max(gpus_per_process, 1)
        if self.peak_flops_per_device is None and trainer.ctx.is_main:
            logger.info(
                "MFU unavailable on %s: no peak FLOP/s known for it (pass the ThroughputMonitor's "
                "peak_flops_per_device); logging achieved FLOP/s only",
                device_name(trainer.ctx.device),
            )

    def on_step_end(self, context: CallbackContext) -> None:
        if context.record is None:
            return
        total = self.flops_per_sample * context.record["samples_per_s"]
        per_device = total / self.num_devices
        context.record["flops_per_s"], context.record["flops_per_s_per_device"] = total, per_device
        if self.peak_flops_per_device:
            context.record["mfu"] = per_device / self.peak_flops_per_device


def model_flops_per_sample(
    model: nn.Module, *, tokens_per_sample: int | None, pipeline_group=None, device: torch.device | None = None
) -> float:
    """Training FLOPs of one sample (see the module docstring for the order of sources)."""
    tokens = tokens_per_sample or 1
    if isinstance(model, CountsFlopsPerSample):
        return float(model.flops_per_sample())
    if isinstance(model, CountsFlopsPerToken):
        return float(model.flops_per_token(tokens)) * tokens
    # DTensor parameters (fsdp, tp) report their global size; pipeline ranks each hold some of the layers.
    parameters = float(sum(p.numel() for p in model.parameters()))
    if pipeline_group is not None:
        parameters = all_reduce_sum(torch.tensor(parameters, device=device), group=pipeline_group).item()
    return 6.0 * parameters * tokens


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """The device's dense peak FLOP/s for dtype ('fp32', 'bf16', 'fp16'), or None when unknown (any CPU)."""
    if device.type != "cuda":
        return None
    return peak_flops_of(device_name(device), dtype, tf32=torch.backends.cuda.matmul.allow_tf32)


def peak_flops_of(name: str, dtype: str, *, tf32: bool = False) -> float | None:
    """PEAK_FLOPS's entry for a GPU name (as torch.cuda.get_device_name spells it), or None."""
    dtype = "tf32" if dtype == "fp32" and tf32 else dtype
    return next((peaks[dtype] for fragment, peaks in PEAK_FLOPS if fragment in name), None)


def compute_dtype(precision: str, fsdp: FSDPConfig, dims: ParallelDims) -> str:
    """The dtype matmuls run in: autocast's (precision), else FSDP's param_dtype, else fp32."""
    if precision != "fp32":
        return precision
    if dims.fsdp_enabled and fsdp.param_dtype:
        return fsdp.param_dtype
    return "fp32"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
