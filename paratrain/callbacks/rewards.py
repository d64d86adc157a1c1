"""DPO's reward statistics in the metrics record, under TRL's names (``rewards/chosen``, ``rewards/rejected``,
``rewards/margins``, ``rewards/accuracies``, ``logps/chosen``, ``logps/rejected``): each a mean over the pairs
of the steps since the last logged one, on every data-parallel rank."""

from __future__ import annotations

import torch

from paratrain.callbacks.base import Callback, CallbackContext
from paratrain.parallel.collectives import all_reduce_sum


def maybe_preference_metrics(loss_fn: object) -> list[Callback]:
    """[PreferenceMetrics(loss_fn)] when the loss keeps preference statistics (paratrain.losses.DPOLoss), else []."""
    return [PreferenceMetrics(loss_fn)] if hasattr(loss_fn, "window_metrics") else []


class PreferenceMetrics(Callback):
    def __init__(self, loss_fn):
        self.loss_fn = loss_fn

    def on_step_end(self, context: CallbackContext) -> None:
        if context.record is None:
            return  # the sums go on to the next logged step
        sums, pairs = self.loss_fn.window_metrics()
        dims = context.trainer.dims
        group = dims.batch_mesh.get_group() if dims.mesh is not None and dims.dp > 1 else None
        names = sorted(sums)
        totals = torch.stack([torch.as_tensor(pairs, dtype=torch.float64)] + [sums[n].double() for n in names])
        totals = all_reduce_sum(totals.to(context.trainer.ctx.device), group=group).cpu()
        if totals[0] > 0:
            context.record.update({name: (totals[i + 1] / totals[0]).item() for i, name in enumerate(names)})
