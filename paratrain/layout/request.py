"""What laying a model out on this rank takes (``LayoutRequest``) and gives (``LaidOutModel``): the types the
flat and the pipeline builders share, so neither imports the other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn
from torch.utils.data import Dataset

from paratrain.config.schema import ParallelConfig, PipelineConfig, TrainConfig
from paratrain.engine import Engine
from paratrain.launch.process_group import DistContext
from paratrain.losses import LossFn
from paratrain.parallel.dims import ParallelDims
from paratrain.parallel.sequence_sharding import SequenceSharding
from paratrain.precision import MixedPrecision


@dataclass(frozen=True)
class LaidOutModel:
    """A rank's model under its layout (flat or pipelined), and the engine that runs a step on it.

    Attributes:
        bare: Parameters under the model's own names (this rank's pieces, under a pipeline): what the
            optimizer and checkpoints see.
        runnable: What forward runs through: the same module for fsdp/tp, a DDP or DataParallel wrapper,
            or a ModuleList of this rank's pipeline stage modules.
        engine: Runs one step's forwards and backwards.
        sequence: This rank's cut of each sequence (context parallel, document masking), which the
            evaluation's forwards use too; None without either.
    """

    bare: nn.Module
    runnable: nn.Module
    engine: Engine
    sequence: SequenceSharding | None = None


@dataclass(frozen=True)
class LayoutRequest:
    """What laying a model out on this rank needs, asked once by the trainer's set-up and read by the flat
    and the pipeline builders alike (rather than relayed to the pipeline's builder keyword by keyword).

    Attributes:
        sample_dataset: Where pipeline.balance=time reads a micro-batch to time the model's pieces on.
        timeline_dir: Where pipeline.record_timeline writes each rank's timeline.
        pretrained: Directory of weights to load instead of initialising (model.pretrained).
        sequence: This rank's cut of each sequence (context parallel, document masking), or None.
        resuming: A checkpoint's load fills the weights next: nothing is initialised.
        seed_checkpoint_dir: Where a plain model's seed checkpoint goes (``run.output_dir``; models/init.py).
    """

    model_factory: Callable[[], nn.Module]
    loss_fn: LossFn
    dims: ParallelDims
    ctx: DistContext
    precision: MixedPrecision
    parallel: ParallelConfig
    pipeline: PipelineConfig
    train: TrainConfig
    sample_dataset: Dataset
    timeline_dir: Path
    pretrained: Path | None = None
    sequence: SequenceSharding | None = None
    resuming: bool = False
    seed_checkpoint_dir: Path | None = None
