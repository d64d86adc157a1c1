"""Laying a model out on this rank: build it on the meta device, apply the layout's parallelisms
(``parallel.parallelize``), materialise it, and pair it with the engine that runs a step on it: micro-batch
accumulation for the flat layouts (``flat.py``), a pipeline schedule over this rank's stages
(``pipelined.py``, imported only when the layout has one). ``request.py`` holds what both take and give.

It sits above ``parallel/`` (the transforms), ``engine`` and ``launch/`` (the rank's process group), and
below the trainer, which asks it once for a :class:`LaidOutModel`."""

from paratrain.layout.flat import build_flat_layout
from paratrain.layout.request import LaidOutModel, LayoutRequest


def build_layout(request: LayoutRequest) -> LaidOutModel:
    """The model and engine of the layout: a pipeline schedule for pp, micro-batch accumulation otherwise."""
    if request.dims.pp_enabled:
        # Deliberately lazy: torch.distributed.pipelining loads torch._dynamo, a second at start-up
        # that layouts without a pipeline would pay for nothing.
        from paratrain.layout.pipelined import build_pipeline_runtime

        return build_pipeline_runtime(request)
    return build_flat_layout(request)


__all__ = ["LaidOutModel", "LayoutRequest", "build_layout"]
