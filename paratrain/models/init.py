"""Allocating and initialising a model that was built on the meta device.

Every layout builds the model on ``meta`` (no memory), applies its parallelism, then materialises here:
each parameter and buffer is allocated as this rank's shard and filled from one of four sources, so that
every layout starts from the same weights as ``single``, and no rank holds more than its shard plus one
full tensor:

1. A resume: nothing is drawn or read. Parameters are left for the checkpoint's load to fill; buffers it
   does not hold (rotary frequencies) come from the constructor.
2. ``model.pretrained`` (safetensors files): each tensor read by name, this rank's slice alone where the
   placement allows; buffers the files lack, from a build whose parameters stay on meta.
3. A model whose own initialisation paratrain can divide: one that declares
   ``init_parameter(name, tensor, generator)`` (``contract.InitialisesParameters``; paratrain's own models
   do), or a transformers model (its ``_init_weights``). The initialisation is recorded as the operations
   it applies to each tensor (``models.init_recording``), and each rank draws only its slice of them
   (``models.init_replay``): values depend only on (seed, name), whatever the layout, and the distribution
   is the model's own (its std, its zeros and ones). A tensor the recording cannot divide (an orthogonal
   init, a copy from another tensor) is initialised whole, from a generator seeded by its name.
4. Any other model (a plain ``nn.Module``, whose constructor is its initialisation): built once for real,
   exactly as ``single`` builds it (seed, then factory), by one process, which writes it as a seed
   checkpoint every rank then reads its slices from (as from ``model.pretrained``). That one process
   briefly holds the whole model; the log says so. Unsharded layouts build such a model directly instead.

A parameter or buffer that no source fills is an error naming it, never uninitialised memory. A factory
calling ``from_pretrained`` (refused on meta by transformers 5) returns real weights: laid out as they are.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from paratrain.errors import ConfigError
from paratrain.models.contract import declares_init
from paratrain.models.hf import is_transformers_model
from paratrain.models.init_recording import initialise_whole, record_declared_init, record_transformers_init
from paratrain.models.init_replay import Box, box_of, drawing_threads, replay
from paratrain.models.lora import init_adapter, is_adapter
from paratrain.models.meta import build_with_parameters_on_meta, on_meta, real_tensors
from paratrain.models.seed_checkpoint import seed_checkpoint
from paratrain.models.weights import LocalPiece, WeightSource, canonical_name

logger = logging.getLogger("paratrain")

NOTHING_TO_COPY = object()  # a source's answer when it filled the tensor itself, or a resume's load will
# Parameters up to this many numbers keep their constructor's value when the model's own init leaves them alone.
SMALL_PARAMETER = 1 << 20


def initialises_piecewise(model: nn.Module) -> bool:
    """Whether each rank can draw its slice of the model's own init (source 3); not where ``from_pretrained`` (in
    eval mode) built on meta (4.x), as that init would replace what it loads: source 4 builds it for real."""
    if is_transformers_model(model):
        return model.training
    return declares_init(model)


def is_on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def build_on_meta(factory: Callable[[], nn.Module], *, seed: int) -> nn.Module:
    """The factory's model on the meta device, or its real model when the factory cannot run under a
    meta-device context (``from_pretrained`` raises there): such a model's weights are what it loaded,
    and are laid out as they are. The seed is set first so that anything it initialises itself is
    the same on every rank."""
    torch.manual_seed(seed)
    try:
        with on_meta():
            return factory()
    except Exception as error:  # a user factory may fail in any way on meta; built for real it fails loudly
        logger.info("model factory does not build on meta (%s: %s): building it for real", type(error).__name__, error)
    torch.manual_seed(seed)
    return factory()


def materialize(
    model: nn.Module,
    *,
    factory: Callable[[], nn.Module],
    device: torch.device,
    seed: int,
    pretrained: Path | None = None,
    allocate_via: list[nn.Module] | None = None,
    resuming: bool = False,
    seed_checkpoint_dir: Path | None = None,
) -> None:
    """Allocates every parameter and buffer on device and fills it (see module docstring).

    Args:
        factory: The model's factory: sources 2-4 build the model again with it (on meta, or with its
            parameters on meta for the buffers, or for real in one process).
        pretrained: Directory of safetensors weights to load instead of initialising.
        allocate_via: Modules that together hold all of the model's tensors, to allocate through
            instead of the model (pipeline stages: when FSDP wraps them, only they re-register
            the sharded parameters it tracks).
        resuming: A checkpoint's load fills the parameters next: nothing is initialised.
        seed_checkpoint_dir: Where a plain model's seed checkpoint is written (storage every rank reads).

    Raises:
        ConfigError: a parameter or buffer that no source fills, or pretrained weights whose names
            or shapes do not match the model.
    """
    if not is_on_meta(model):
        return
    tied = _tied_parameters(model)
    with _weight_source(
        model, factory=factory, seed=seed, pretrained=pretrained, resuming=resuming, scratch=seed_checkpoint_dir
    ) as source:
        for module in allocate_via if allocate_via is not None else [model]:
            module.to_empty(device=device)
        _tie_again(tied)
        _fill(model, source, pretrained=pretrained)


def _fill(model: nn.Module, source: WeightSource, *, pretrained: Path | None) -> None:
    missing = []
    with torch.no_grad():
        for name, tensor in _named_tensors(model):
            name = canonical_name(name)
            full = source(name, tensor)
            if full is None:
                missing.append(name)
            elif full is not NOTHING_TO_COPY:
                _copy_my_slice(tensor, full)
    if missing:
        raise ConfigError(
            f"model: no initial values for {_first_few(missing)} ({len(missing)} tensors): {_fix(pretrained)}"
        )


def _tied_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Where one parameter is registered under several names (a head tied to the embedding), each place.

    ``to_empty`` gives every registration a tensor of its own, which would untie them: a layout that keeps
    tied modules apart from FSDP's units (tp alone) then trained two weights where the model has one."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            places.setdefault(id(param), []).append((module, name))
    return [group for group in places.values() if len(group) > 1]


def _tie_again(tied: list[list[tuple[nn.Module, str]]]) -> None:
    for (first_module, first_name), *others in tied:
        shared = getattr(first_module, first_name)
        for module, name in others:
            setattr(module, name, shared)


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


@contextlib.contextmanager
def _weight_source(
    model: nn.Module,
    *,
    factory: Callable[[], nn.Module],
    seed: int,
    pretrained: Path | None,
    resuming: bool,
    scratch: Path | None,
) -> Iterator[WeightSource]:
    if resuming:
        buffers = _constructor_tensors(factory, keep_parameters=False)
        logger.info("weights: left for the checkpoint being resumed (nothing initialised)")
        yield lambda name, tensor: buffers.get(name, NOTHING_TO_COPY)
    elif pretrained is not None:
        from paratrain.models.pretrained import pretrained_source  # lazy: safetensors only for model.pretrained

        base = pretrained_source(model, pretrained, buffers=_constructor_tensors(factory, keep_parameters=False))
        yield _with_adapters(base, seed)
    elif initialises_piecewise(model):
        with drawing_threads():  # kept for every tensor drawn, ended with the init
            yield _with_adapters(_replayed_source(model, factory=factory, seed=seed), seed)
    else:
        with seed_checkpoint(factory, seed=seed, directory=scratch) as directory:
            # lazy: as for model.pretrained, the seed checkpoint is safetensors
            from paratrain.models.pretrained import pretrained_source

            buffers = _constructor_tensors(factory, keep_parameters=False)
            yield pretrained_source(model, directory, buffers=buffers, what="the seed checkpoint")


def _with_adapters(base: WeightSource, seed: int) -> WeightSource:
    """LoRA adapters are in no file and no model init: drawn by name, so every layout starts from the same ones."""
    return lambda name, tensor: init_adapter(name, tensor, seed) if is_adapter(name) else base(name, tensor)


def _replayed_source(model: nn.Module, *, factory: Callable[[], nn.Module], seed: int) -> WeightSource:
    """Source 3: each rank's slice drawn from the model's recorded initialisation (see module docstring)."""
    if declares_init(model):
        # Built only if some tensor needs it (the model's init left it alone): most such models never do.
        buffers = functools.cache(lambda: _constructor_tensors(factory, keep_parameters=False))
        whole = lambda name, tensor: _init_by_name(model, name, tensor, seed)  # noqa: E731
        recorded = lambda name, tensor: record_declared_init(model, name, tensor)  # noqa: E731
    else:
        # One build serves the recording (its parameters on meta) and gives the buffers the constructor
        # computes (rotary frequencies), which the model's init leaves alone.
        reference = _constructed_model(factory, keep_parameters=False, seed=seed)
        records, reference_buffers = record_transformers_init(reference), real_tensors(reference)
        buffers = lambda: reference_buffers  # noqa: E731
        whole = lambda name, tensor: initialise_whole(reference, name, seed=seed)  # noqa: E731
        recorded = lambda name, tensor: records.get(name)  # noqa: E731
    # Rarely a parameter the model's init leaves alone: its constructor's value, from a build that keeps the
    # small parameters (and so draws them).
    small_parameters = functools.cache(lambda: _constructor_tensors(factory, keep_parameters=True, seed=seed))

    def constructed(name: str) -> torch.Tensor | None:
        return buffers()[name] if name in buffers() else small_parameters().get(name)

    def source(name: str, tensor: torch.Tensor) -> torch.Tensor | LocalPiece | None:
        record, shape = recorded(name, tensor), tuple(tensor.shape)
        if record is not None and record.opaque:
            return whole(name, tensor)
        if record is None or not record.starts_whole():
            # Not (wholly) set by the model's init: its constructor's value, where it is small enough to keep.
            base = constructed(name)
            return (
                None
                if base is None
                else replay(record, name=name, seed=seed, shape=shape, box=Box.whole(shape), base=base)
            )
        box = box_of(tensor)
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if box is not None and local.device.type == "cpu" and local.is_contiguous():
            replay(record, name=name, seed=seed, shape=shape, box=box, out=local)  # no copy of the shard
            return NOTHING_TO_COPY
        # Drawn on the CPU (a GPU's generators give other numbers), then copied to the device.
        values = replay(record, name=name, seed=seed, shape=shape, box=box or Box.whole(shape), dtype=tensor.dtype)
        return LocalPiece(values) if box is not None and isinstance(tensor, DTensor) else values

    return source


def _init_by_name(model: nn.Module, name: str, tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """A declared-init model's whole tensor, drawn for real from a generator seeded by (seed, name)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    full = torch.empty(tensor.shape, dtype=tensor.dtype)
    model.init_parameter(name, full, generator)
    return full


def build_whole(factory: Callable[[], nn.Module], *, device: torch.device, seed: int) -> nn.Module:
    """The whole model with initial values on ``device``, in this one process (timing a pipeline's pieces on
    rank 0, where the values need only be the model's kind of values): drawn piecewise where the model
    allows it, else built for real."""
    model = build_on_meta(factory, seed=seed)
    if is_on_meta(model) and initialises_piecewise(model):
        materialize(model, factory=factory, device=device, seed=seed)
        return model
    torch.manual_seed(seed)
    return (factory() if is_on_meta(model) else model).to(device)


def _constructor_tensors(
    factory: Callable[[], nn.Module], *, keep_parameters: bool, seed: int | None = None
) -> dict[str, torch.Tensor]:
    """The buffers the model's constructor computes (rotary frequencies, masks) and, with ``keep_parameters``,
    its small parameters (up to ``SMALL_PARAMETER`` numbers: norms, biases). Gives a parameter the model's
    own init leaves alone its constructor's value, without building the large ones."""
    return real_tensors(_constructed_model(factory, keep_parameters=keep_parameters, seed=seed))


def _constructed_model(factory: Callable[[], nn.Module], *, keep_parameters: bool, seed: int | None) -> nn.Module:
    if seed is not None:  # what the constructor draws (a kept parameter) is then the same on every rank
        torch.manual_seed(seed)
    return build_with_parameters_on_meta(factory, larger_than=SMALL_PARAMETER if keep_parameters else -1)


def _copy_my_slice(tensor: torch.Tensor, full: torch.Tensor | LocalPiece) -> None:
    if isinstance(full, LocalPiece):
        tensor.to_local().copy_(full.tensor)
        return
    full = full.to(tensor.dtype)
    if isinstance(tensor, DTensor):
        # src_data_rank=None: every rank holds the same full tensor, so each keeps its slice, no comms.
        local = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
        tensor.to_local().copy_(local)
    else:
        tensor.copy_(full)


def _first_few(names: list[str], count: int = 5) -> str:
    return ", ".join(names[:count]) + (", ..." if len(names) > count else "")


def _fix(pretrained: Path | None) -> str:
    if pretrained is not None:
        return f"model.pretrained={str(pretrained)!r} does not hold them; point it at the weights of this model"
    return "the model's factory must create them (a module created on meta with no values cannot be trained)"
