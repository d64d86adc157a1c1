"""Allocating and initialising a model that was built on the meta device.

Sharded layouts build the model on ``meta`` (no memory), apply their parallelism, then materialise
here: every parameter and buffer is allocated as this rank's shard and filled, one full tensor at a
time, from one of three sources, so that every layout starts from the same weights as ``single``:

1. ``model.pretrained`` (a directory of safetensors files): each tensor read by name from the files.
   Buffers the files do not hold (non-persistent ones such as rotary ``inv_freq``) come from a build of
   the model whose parameters stay on meta, so its constructor computes them as usual.
2. A model that declares ``init_parameter(name, tensor, generator)`` (``contract.InitialisesParameters``;
   paratrain's own models do): values that depend only on ``(seed, name)``, each full tensor drawn on
   the CPU from a generator seeded by the two. Nothing holds the whole model at once: the path for models larger than host memory.
3. Any other model (a plain ``nn.Module``, a ``transformers`` model with its ``_init_weights``): built
   once for real on the CPU after ``torch.manual_seed(seed)``, exactly as ``single`` builds it, and each
   rank keeps its slice of what was built. Each rank briefly holds the whole model in host memory.

Each rank draws or reads the same full tensor and keeps its own slice (``distribute_tensor`` with
``src_data_rank=None``): random initialisation of a sharded DTensor is not used, since on a CPU mesh
DTensor has no random-number tracker and every shard would get the same numbers. A parameter or
buffer that no source fills is an error naming it, never uninitialised memory.

A factory that returns real weights itself (for example one calling ``from_pretrained``, which
transformers 5 refuses under a meta-device context) is detected by ``build_on_meta``: its model is laid
out as it is and nothing here runs. (transformers 4.x with accelerate installed does build it on meta;
source 3 then loads it again for real, so the weights are still the ones it loaded.)
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from paratrain.errors import ConfigError
from paratrain.models.contract import declares_init
from paratrain.models.lora import init_adapter, is_adapter
from paratrain.models.meta import on_meta
from paratrain.models.weights import LocalPiece, WeightSource, canonical_name

logger = logging.getLogger("paratrain")


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
) -> None:
    """Allocates every parameter and buffer on device and fills it (see module docstring).

    Args:
        factory: The model's factory: source 3 builds the reference model with it, source 1 the
            non-persistent buffers.
        pretrained: Directory of safetensors weights to load instead of initialising.
        allocate_via: Modules that together hold all of the model's tensors, to allocate through
            instead of the model (pipeline stages: when FSDP wraps them, only they re-register
            the sharded parameters it tracks).

    Raises:
        ConfigError: a parameter or buffer that no source fills, or pretrained weights whose names
            or shapes do not match the model.
    """
    if not is_on_meta(model):
        return
    source = _weight_source(model, factory=factory, seed=seed, pretrained=pretrained)
    tied = _tied_parameters(model)
    for module in allocate_via if allocate_via is not None else [model]:
        module.to_empty(device=device)
    _tie_again(tied)
    missing = []
    with torch.no_grad():
        for name, tensor in _named_tensors(model):
            name = canonical_name(name)
            full = source(name, tensor)
            if full is None:
                missing.append(name)
            else:
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


def _weight_source(
    model: nn.Module, *, factory: Callable[[], nn.Module], seed: int, pretrained: Path | None
) -> WeightSource:
    if pretrained is not None:
        # lazy: safetensors is loaded only for runs with model.pretrained
        from paratrain.models.pretrained import pretrained_source  # safetensors: only when loading

        base = pretrained_source(model, pretrained, buffers=_buffers_of_parameterless_build(factory))
        # LoRA adapters are not in the files: drawn by name, so every layout starts from the same ones.
        return lambda name, tensor: init_adapter(name, tensor, seed) if is_adapter(name) else base(name, tensor)
    if declares_init(model):
        return lambda name, tensor: _init_by_name(model, name, tensor, seed)
    return _reference_source(factory, seed)


def _init_by_name(model: nn.Module, name: str, tensor: torch.Tensor, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    full = torch.empty(tensor.shape, dtype=tensor.dtype)
    model.init_parameter(name, full, generator)
    return full


def _reference_source(factory: Callable[[], nn.Module], seed: int) -> WeightSource:
    """The model built for real on the CPU, as ``single`` builds it (seed, then factory)."""
    torch.manual_seed(seed)
    with torch.device("cpu"):
        reference = dict(_named_tensors(factory()))
    return lambda name, tensor: reference.get(name)


def _buffers_of_parameterless_build(factory: Callable[[], nn.Module]) -> dict[str, torch.Tensor]:
    """The buffers the model's constructor computes (rotary frequencies, masks), from a build whose
    parameters go to meta as they are registered (Accelerate's ``init_empty_weights`` does the same)."""
    with _parameters_on_meta(), torch.device("cpu"):
        model = factory()
    return {name: buffer for name, buffer in model.named_buffers() if not buffer.is_meta}


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            kind, kwargs = type(param), param.__dict__
            module._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name].__dict__.update(kwargs)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


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
