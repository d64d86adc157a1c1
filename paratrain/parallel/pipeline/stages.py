"""Pipeline stages as modules: each rank keeps only the pieces of its own stages.

The model is built whole on the meta device (no memory), then every piece that belongs to another
rank's stage is swapped for an empty placeholder. What remains keeps the model's own parameter names
(``blocks.3.attn.q_proj.weight``), so checkpoints, the optimizer and ``export`` see the same names
under every layout, and a pipeline checkpoint loads into a single process and the reverse.

A ``StageModule`` runs one stage: its pieces, called in order. It holds the very module objects the
pruned model holds, so sharding, data parallel and the pipeline runtime act on the stage while
checkpoints act on the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


class RemovedPiece(nn.Module):
    """Stands where a piece owned by another pipeline rank was; holds nothing and must not be called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this piece of the model lives on another pipeline rank")


class StageModule(nn.Module):
    """Consecutive pieces of a model, each fed the previous one's output (one pipeline stage).

    Args:
        layer_inputs: The plan's ``pipeline_layer_inputs``: the pieces it names also get the keyword
            inputs it computes from the stage's input (computed once per stage call), and the modules it
            needs (a rotary embedding) are held here, so every stage allocates and moves them.
    """

    def __init__(
        self,
        pieces: Sequence[nn.Module],
        paths: Sequence[str],
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        layer_inputs: Any = None,
    ):
        super().__init__()
        self.pieces = nn.ModuleList(pieces)
        self.paths = tuple(paths)  # the model's names for the pieces, for messages and logs
        self._autocast = autocast
        self._layer_inputs = layer_inputs
        self._takes_inputs = [layer_inputs is not None and path in layer_inputs.layers for path in self.paths]
        if layer_inputs is not None:
            self.layer_context = nn.ModuleList(layer_inputs.modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            inputs_of = None
            for piece, path, takes_inputs in zip(self.pieces, self.paths, self._takes_inputs):
                if not takes_inputs:
                    x = piece(x)
                    continue
                inputs_of = inputs_of or self._layer_inputs.compute(x)
                x = piece(x, **inputs_of(path))
        return x

    def extra_repr(self) -> str:
        return ", ".join(self.paths)


def keep_only(model: nn.Module, sequence: Sequence[str], kept: set[str]) -> None:
    """Replaces (in place) every piece of the sequence not in ``kept`` by a RemovedPiece."""
    for path in sequence:
        if path not in kept:
            parent_path, _, name = path.rpartition(".")
            model.get_submodule(parent_path).register_module(name, RemovedPiece())


def stage_modules(
    model: nn.Module,
    stages: Sequence[Sequence[str]],
    autocast: Callable[[], contextlib.AbstractContextManager],
    layer_inputs: Any = None,
) -> list[StageModule]:
    """A StageModule per stage, over the model's current modules (call after wrappers replaced any)."""
    return [
        StageModule([model.get_submodule(path) for path in paths], paths, autocast, layer_inputs) for paths in stages
    ]
