"""Laying a model out on this rank: build it on the meta device, apply the layout's parallelisms
(``parallel.parallelize``), materialise it, and pair it with the engine that runs a step on it: micro-batch
accumulation for the flat layouts (``build.py``), a pipeline schedule over this rank's stages
(``pipeline.py``, imported only when the layout has one).

It sits above ``parallel/`` (the transforms), ``engine`` and ``launch/`` (the rank's process group), and
below the trainer, which asks it once for a :class:`LaidOutModel`."""

from paratrain.layout.build import LaidOutModel, build_layout

__all__ = ["LaidOutModel", "build_layout"]
