"""Small ``build_*`` helpers the Trainer calls in order, each from its own config section."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import Dataset

from paratrain.config import Config, ParallelConfig
from paratrain.data.sampler import GlobalBatchSampler
from paratrain.parallel.data_parallel import apply_data_parallel
from paratrain.parallel.ddp import apply_ddp


def build_parallel_model(model: nn.Module, options: ParallelConfig, *, mesh: DeviceMesh | None, device: torch.device) -> nn.Module:
    """Moves the model to its device and applies the layout. The returned module is what forward
    runs through; ``model`` itself keeps the parameters and their plain names."""
    model.to(device)
    if options.strategy == "ddp":
        ddp = options.ddp
        return apply_ddp(model, mesh, device=device, bucket_cap_mb=ddp.bucket_cap_mb, static_graph=ddp.static_graph,
                         find_unused_parameters=ddp.find_unused_parameters,
                         gradient_as_bucket_view=ddp.gradient_as_bucket_view)
    if options.strategy == "dp":
        return apply_data_parallel(model, device=device)
    return model


def build_sampler(dataset_size: int, config: Config, *, dp_rank: int, dp_size: int) -> GlobalBatchSampler:
    return GlobalBatchSampler(
        dataset_size=dataset_size,
        global_batch_size=config.train.global_batch_size,
        micro_batch_size=config.train.micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=config.train.seed,
        shuffle=config.data.shuffle,
    )


def tokens_per_sample(dataset: Dataset) -> int | None:
    """Token count of one sample when its inputs are token ids (integer tensors), else None."""
    inputs = dataset[0][0]
    is_tokens = isinstance(inputs, torch.Tensor) and not inputs.is_floating_point()
    return inputs.numel() if is_tokens else None
