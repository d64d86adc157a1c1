"""A model whose pipeline stages cost the same, for the bubble benchmark (``pipeline_bubble.py``).

Identical blocks (Linear + tanh, width x width) in an ``nn.Sequential``, so any even cut gives stages
of equal compute; features in, features out, mean-squared error.

With ``delay_ms`` > 0 each block also sleeps: delay_ms in forward, delay_ms on the input-gradient
path and delay_ms on the weight-gradient path of backward (sleeping releases the GIL and uses no
CPU). A small width then makes the sleeps the cost, which gives exactly the uniform costs the theory
assumes (F = I = W, full backward = 2F) without two ranks fighting over 2 cores. A first ``Scale``
piece makes the first block's input need a gradient, so the first stage's backward is as long as
the others' (real data needs none, which would make stage 0 cheaper). Each block also counts the bytes it
saves for backward (``saved_tensors_hooks``): a count goes up when autograd stores a tensor and down
when autograd frees it, and the peak per process is written at exit to
``$PARATRAIN_BENCH_ACTIVATIONS/activations-<pid>.json``. That is the activation memory a schedule
keeps alive, which is where GPipe (all m micro-batches in flight) and 1F1B (at most p) differ.
"""

from __future__ import annotations

import atexit
import json
import os
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


class _SavedBytes:
    """Bytes of activations saved for backward that are alive now, and the most there were."""

    def __init__(self):
        self.alive = 0
        self.peak = 0

    def pack(self, tensor: torch.Tensor, weights: frozenset[int] = frozenset()):
        holder = _Held(tensor)
        if tensor.data_ptr() in weights:  # autograd saves the weight too; it is not an activation
            return holder
        size = tensor.numel() * tensor.element_size()
        self.alive += size
        self.peak = max(self.peak, self.alive)
        weakref.finalize(holder, self._release, size)  # autograd drops the holder when it frees the tensor
        return holder

    def _release(self, size: int) -> None:
        self.alive -= size


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


SAVED = _SavedBytes()


class _Sleep(torch.autograd.Function):
    """Identity that sleeps forward_s in forward and backward_s in backward."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class UniformBlock(nn.Module):
    def __init__(self, width: int, delay_s: float = 0.0):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = frozenset(p.data_ptr() for p in self.parameters())
        with torch.autograd.graph.saved_tensors_hooks(lambda t: SAVED.pack(t, weights), lambda held: held.tensor):
            if not self.delay_s:
                return torch.tanh(self.linear(x))
            x = _Sleep.apply(x, self.delay_s, self.delay_s)  # forward, and the input-gradient path
            weight = _Sleep.apply(self.linear.weight, 0.0, self.delay_s)  # the weight-gradient path
            return torch.tanh(F.linear(x, weight, self.linear.bias))


class Scale(nn.Module):
    """x * a learned scale (starting at 1): gives the first block's input a gradient path."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def build_model(*, width: int = 512, depth: int = 8, delay_ms: float = 0.0) -> nn.Sequential:
    _write_peak_at_exit()
    blocks = [UniformBlock(width, delay_ms / 1e3) for _ in range(depth)]
    return nn.Sequential(Scale(), *blocks) if delay_ms else nn.Sequential(*blocks)


def build_data(*, width: int = 512, samples: int = 4096) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(samples, width, generator=generator)
    return TensorDataset(inputs, torch.tanh(inputs.flip(1)))


_registered = False


def _write_peak_at_exit() -> None:
    global _registered
    directory = os.environ.get("PARATRAIN_BENCH_ACTIVATIONS")
    if directory and "RANK" in os.environ and not _registered:  # workers only, not the launcher's preflight
        _registered = True
        path = Path(directory) / f"activations-{os.getpid()}.json"
        atexit.register(
            lambda: path.write_text(json.dumps({"rank": int(os.environ["RANK"]), "peak_bytes": SAVED.peak}))
        )
