"""Building what a rank trains, in the order the trainer asks: its process and mesh (``resolve_dims``,
``init_rank``), its data (``load_dataset``, ``build_feed``), then its model under its layout
(``build_rank_model``, through ``layout.build_layout``). Each function takes its config sections, never
the root config."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from paratrain.config.factories import call_factory
from paratrain.config.schema import (
    DataConfig,
    DebugConfig,
    EvalConfig,
    FactoryConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    PipelineConfig,
    TrainConfig,
)
from paratrain.cuda_settings import apply_kernel_settings
from paratrain.data.feed import DataFeed
from paratrain.data.model_fit import SampleSources, check_dataset_fits_model
from paratrain.data.shared_cache import cache_key
from paratrain.data.stream import StreamedTokens, check_streaming
from paratrain.debug import dump_weights
from paratrain.engine import MicroBatchEngine
from paratrain.evaluation import Evaluator, build_evaluator
from paratrain.launch.attempt_memory import passed_in_an_earlier_attempt, record_passed
from paratrain.launch.process_group import (
    DistContext,
    init_distributed,
    local_world_size_from_env,
    world_size_from_env,
)
from paratrain.layout import LaidOutModel, LayoutRequest, build_layout
from paratrain.losses import LossFn
from paratrain.models.lora import apply_lora
from paratrain.models.meta import maybe_build_on_meta
from paratrain.parallel.activation import compile_loss
from paratrain.parallel.ddp import settle_buckets
from paratrain.parallel.devices import devices_computed_on
from paratrain.parallel.dims import ParallelDims, micro_batch_size, resolve_parallel_dims
from paratrain.parallel.documents import boundaries_of
from paratrain.parallel.sequence_sharding import build_sequence_sharding
from paratrain.precision import MixedPrecision, Precision, build_mixed_precision
from paratrain.training.preference_reference import NoPreferenceReference, PreferenceReference

logger = logging.getLogger("paratrain")
# The sample check on meta, under the name a restart looks its earlier pass up by.
FIT_CHECK = "dataset-fits-model"


def resolve_dims(parallel: ParallelConfig) -> ParallelDims:
    """The ``parallel`` section's degrees for the world the launcher started (no process group yet)."""
    return resolve_parallel_dims(
        parallel, world_size=world_size_from_env(), local_world_size=local_world_size_from_env()
    )


def init_rank(dims: ParallelDims, *, parallel: ParallelConfig, train: TrainConfig) -> tuple[DistContext, ParallelDims]:
    """This process's device and, when the layout needs one, its process group; then the device's kernel
    settings (``train.deterministic``). Returns the process and ``dims`` with its named mesh on that device."""
    ctx = init_distributed(
        device_kind=train.device,
        needs_group=dims.needs_process_group,
        timeout_s=parallel.collective_timeout_s,
        cpu_collectives=dims.fsdp_enabled and parallel.fsdp.cpu_offload,
    )
    apply_kernel_settings(ctx.device, deterministic=train.deterministic)
    dims = dims.with_mesh(ctx.device.type)
    logger.info("layout %s on %s", dims.describe_layout(), ctx.device)
    return ctx, dims


def describe_sources(
    *, data: FactoryConfig, model: FactoryConfig, loss: FactoryConfig, given: tuple[bool, bool, bool]
) -> SampleSources:
    """How the user named the data, model and loss, for messages: the object given to the Trainer
    (``given`` says which of data, model, loss were), else the config's factory."""
    data_given, model_given, loss_given = given
    return SampleSources(
        "the dataset given to Trainer" if data_given else f"data.factory={data.factory!r}",
        "the model_factory given to Trainer" if model_given else f"model.factory={model.factory!r}",
        "the loss_fn given to Trainer" if loss_given else f"loss.factory={loss.factory!r}",
    )


def load_dataset(dataset: Dataset | None, data: DataConfig, *, dims: ParallelDims) -> Dataset:
    """``dataset``, or ``data.factory``'s when it is None. A stream is refused now what it cannot do, before
    anything is built for it."""
    dataset = dataset if dataset is not None else call_factory(data, key="data")
    if isinstance(dataset, StreamedTokens):
        check_streaming(data, pipeline_stages=dims.pp)
    return dataset


def build_feed(
    dataset: Dataset,
    *,
    data: DataConfig,
    train: TrainConfig,
    pipeline: PipelineConfig,
    dims: ParallelDims,
    device: torch.device,
) -> DataFeed:
    """This rank's share of each global batch (micro-batches of train.micro_batch_size, or as many as
    pipeline.microbatches asks for) of ``dataset``."""
    return DataFeed(
        dataset,
        data,
        global_batch_size=train.global_batch_size,
        micro_batch_size=micro_batch_size(train, pipeline, dims=dims),
        seed=train.seed,
        dp_rank=dims.dp_rank,
        dp_size=dims.dp,
        pin_memory=device.type == "cuda",
    )


@dataclass(frozen=True)
class RankModel:
    """What this rank trains: the laid-out model and engine, their mixed precision, the loss they use
    (compiled beside the blocks when ``parallel.compile`` is on; evaluation uses it too), and the devices
    the model computes on (several under dp and model_parallel)."""

    layout: LaidOutModel
    precision: MixedPrecision
    loss_fn: LossFn
    devices: list[torch.device]


def build_rank_model(
    model_factory: Callable[[], nn.Module],
    loss_fn: LossFn,
    dataset: Dataset,
    *,
    given: tuple[bool, bool, bool],
    dims: ParallelDims,
    ctx: DistContext,
    sections: RankSections,
    output_dir: Path,
    resuming: bool = False,
) -> RankModel:
    """Checks one sample against the model on meta (shapes and token ids, before allocating), compiles the
    loss if asked, lays the model out, and writes its initial weights when ``debug.dump_initial_weights`` asks.

    Args:
        dataset: Where the sample check and pipeline.balance=time read samples.
        given: Whether the dataset, the model factory and the loss came from the caller (not the config's
            factories), for messages.
        output_dir: ``run.output_dir``: the pipeline's timelines and the initial weights go under it.
        resuming: A checkpoint's load fills the weights next: nothing is initialised (models/init.py).
    """
    started = time.perf_counter()
    model_factory = with_lora(model_factory, sections.model.lora)
    if not isinstance(dataset, StreamedTokens):  # a stream's samples cannot be read by index
        sources = describe_sources(data=sections.data, model=sections.model, loss=sections.loss, given=given)
        maybe_check_dataset_fits_model(
            dataset, model_factory, loss_fn, sources=sources, sections=sections, given=given, output_dir=output_dir
        )
    parallel, pretrained = sections.parallel, sections.model.pretrained
    precision = build_mixed_precision(sections.precision, device=ctx.device, sharded=dims.is_sharded)
    loss_fn = compile_loss(loss_fn, compile=parallel.compile, backend=parallel.compile_backend)
    request = LayoutRequest(
        model_factory,
        loss_fn,
        dims=dims,
        ctx=ctx,
        precision=precision,
        parallel=parallel,
        pipeline=sections.pipeline,
        train=sections.train,
        sample_dataset=dataset,
        timeline_dir=output_dir / "pipeline",
        pretrained=Path(pretrained) if pretrained else None,
        sequence=build_sequence_sharding(dims, documents=boundaries_of(dataset)),
        resuming=resuming,
        seed_checkpoint_dir=output_dir,
    )
    layout = build_layout(request)
    # transformers' from_pretrained returns its model in eval mode; it trains with dropout on, as under the HF Trainer.
    layout.bare.train()
    # Start-up's largest part at scale, so users (and benchmarks/vs_torchtitan.py) can see it apart.
    logger.info("model ready in %.1f s (built, initialised, laid out)", time.perf_counter() - started)
    if sections.debug.dump_initial_weights and resuming:
        logger.info("debug.dump_initial_weights: resuming, so there are no initial weights to write")
    elif sections.debug.dump_initial_weights:
        pipeline_group = dims.pp_mesh.get_group() if dims.pp_enabled else None
        path = output_dir / "initial-weights.safetensors"
        dump_weights(layout.bare, path, is_main=ctx.is_main, pipeline_group=pipeline_group)
    return RankModel(layout, precision, loss_fn, devices_computed_on(layout.runnable, own=ctx.device))


def maybe_check_dataset_fits_model(
    dataset: Dataset,
    model_factory: Callable[[], nn.Module],
    loss_fn: LossFn,
    *,
    sources: SampleSources,
    sections: RankSections,
    given: tuple[bool, bool, bool],
    output_dir: Path,
) -> None:
    """The sample check on meta, unless an earlier attempt of this launch passed it on the same data, model and
    loss sections (``launch/attempt_memory.py``: a restarted replica group is what the live ones wait for). Never
    skipped for a dataset, model or loss the caller gave, which no section describes."""
    digest = None
    if not any(given):
        digest = cache_key(
            {name: getattr(sections, name).model_dump(mode="json") for name in ("data", "model", "loss")}
        )
        if passed_in_an_earlier_attempt(output_dir, check=FIT_CHECK, digest=digest):
            return
    check_dataset_fits_model(dataset, maybe_build_on_meta(model_factory), loss_fn, sources=sources)
    if digest is not None:
        record_passed(output_dir, check=FIT_CHECK, digest=digest)


def with_lora(model_factory: Callable[[], nn.Module], lora: LoraConfig | None) -> Callable[[], nn.Module]:
    """The factory's model with ``model.lora``'s adapters wrapped around it (the factory itself without)."""
    if lora is None:
        return model_factory
    return lambda: apply_lora(model_factory(), lora)


def build_rank_evaluator(
    options: EvalConfig, dataset: Dataset | None, built: RankModel, *, dims: ParallelDims, train: TrainConfig
) -> Evaluator | None:
    """The evaluator of the laid-out model (see evaluation.build_evaluator): its forwards run as training's do,
    under its mixed precision and its cut of each sequence."""
    return build_evaluator(
        options,
        dataset,
        built.loss_fn,
        model=built.layout.runnable,
        device=built.layout.engine.device,
        autocast=built.precision.autocast,
        dims=dims,
        train=train,
        sequence=built.layout.sequence,
    )


def build_preference_reference(
    dataset: Dataset, built: RankModel, *, dims: ParallelDims, train: TrainConfig
) -> PreferenceReference | NoPreferenceReference:
    """DPO's reference log-probabilities (training/preference_reference.py) when the data is preference pairs."""
    if not getattr(dataset, "is_preference_data", False):
        return NoPreferenceReference()
    layout = built.layout
    return PreferenceReference(
        dataset,
        model=layout.runnable,
        sequence=layout.sequence,
        autocast=built.precision.autocast,
        device=layout.engine.device,
        dims=dims,
        micro_batch_size=train.micro_batch_size,
    )


@dataclass(frozen=True)
class RankSections:
    """The config sections that decide how a rank's model is built and laid out, each under the root
    config's name for it (the Trainer fills them by name)."""

    model: ModelConfig
    loss: FactoryConfig
    data: DataConfig
    parallel: ParallelConfig
    pipeline: PipelineConfig
    train: TrainConfig
    debug: DebugConfig
    precision: Precision  # the root's "precision" key: fp32, bf16 or fp16


def settle_resumed_layout(
    model: nn.Module, engine: MicroBatchEngine, feed: DataFeed, *, dims: ParallelDims, device: torch.device
) -> None:
    """Brings DDP past its first iteration after a resume, changing nothing (see settle_buckets). Any samples
    do: only the order in which gradients become ready matters. One micro-batch, or a whole step's worth
    for a pipeline's schedule."""
    micro_batch = default_collate(feed.first_samples(feed.micro_batch_size))
    count = feed.micro_batches_per_step if dims.pp > 1 else 1
    settle_buckets(model, lambda: engine.forward_backward([micro_batch] * count), device=device)
