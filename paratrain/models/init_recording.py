"""A model's own initialisation, recorded as the in-place operations it applies to each tensor, without
drawing a number.

paratrain initialises a model that was built on the meta device one rank's slice at a time
(``models.init_replay``). What to draw comes from the model itself: its ``init_parameter`` hook, or a
transformers model's ``_init_weights``. Each is run once, module by module, on *probes*: empty CPU tensors
of the full shapes, never written (so they take address space, not memory), under a torch dispatch mode
that records every in-place operation aimed at a probe (``normal_(0, 0.02)``, ``zero_()``, ``fill_(1.0)``;
``uniform_(-b, b)`` then ``erfinv_()``, ``mul_()``, ``add_()``, ``clamp_()`` for a truncated normal) instead
of running it. The mode sits below ``torch.nn.init`` and transformers' wrappers, so what is recorded is what
they apply to the tensor itself (a Kaiming bound computed from the full shape, as the model would).

Anything else that reads or writes a probe (a copy from another tensor, an orthogonal init's QR, an
operation with a tensor argument) marks that tensor *opaque*: it is then initialised whole, for real, from
a generator seeded by its name (``RecordedInit.opaque``), which is exact but not divided by the shard.
"""

from __future__ import annotations

import collections
import contextlib
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Random in-place methods a replay draws block by block from its own generators.
RANDOM_METHODS = frozenset(
    {"normal_", "uniform_", "bernoulli_", "exponential_", "log_normal_", "cauchy_", "geometric_", "random_"}
)
# In-place methods that act on each element alone (given scalar arguments): replayed on a slice as they are.
ELEMENTWISE_METHODS = frozenset(
    {
        "zero_", "fill_", "mul_", "add_", "sub_", "div_", "clamp_", "clamp_min_", "clamp_max_", "erfinv_",
        "abs_", "neg_", "exp_", "log_", "sqrt_", "pow_", "sign_", "tanh_", "sigmoid_", "reciprocal_", "floor_",
        "ceil_", "round_", "trunc_",
    }
)  # fmt: skip
# A whole-tensor operation of these replaces every earlier value: what came before it is never drawn.
OVERWRITING_METHODS = RANDOM_METHODS | {"zero_", "fill_"}
# Operations that only make a view of a probe (or look at its shape) and may run on it as they are.
_VIEWING = frozenset(
    {
        "view", "_unsafe_view", "alias", "detach", "t", "transpose", "permute", "select", "slice", "narrow",
        "as_strided", "expand", "squeeze", "unsqueeze", "unbind", "split", "split_with_sizes", "chunk",
        "unflatten", "lift_fresh", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_contiguous",
        "new_empty", "new_empty_strided",
    }
)  # fmt: skip


@dataclass(frozen=True)
class View:
    """Which elements of the full (contiguous) tensor an operation touched, when not all of them."""

    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class InitOp:
    """One recorded in-place operation: ``tensor[view].method(*args, **kwargs)``."""

    method: str
    args: tuple
    kwargs: tuple[tuple[str, Any], ...] = ()
    view: View | None = None  # None: the whole tensor

    @property
    def random(self) -> bool:
        return self.method in RANDOM_METHODS

    @property
    def overwrites(self) -> bool:
        """Whether it sets every element of the tensor, whatever it held before."""
        return self.view is None and self.method in OVERWRITING_METHODS


@dataclass
class RecordedInit:
    """Everything the model's initialisation did to one tensor, in order."""

    ops: list[InitOp] = field(default_factory=list)
    opaque: bool = False  # something a slice cannot replay happened: the tensor is initialised whole

    def effective(self) -> list[tuple[int, InitOp]]:
        """(position, op) from the last whole-tensor overwrite on: earlier writes are never drawn (an
        ``nn.Linear``'s default init that the model's own then replaces costs nothing)."""
        start = 0
        for position, op in enumerate(self.ops):
            if op.overwrites:
                start = position
        return list(enumerate(self.ops))[start:]

    def starts_whole(self) -> bool:
        """Whether the effective operations begin by setting the whole tensor (so no earlier value matters)."""
        effective = self.effective()
        return bool(effective) and effective[0][1].overwrites


class _Recorder(TorchDispatchMode):
    """Records the in-place operations aimed at probes (see module docstring) instead of running them."""

    def __init__(self, probes: dict[int, tuple[str, torch.Tensor]], records: dict[str, RecordedInit]):
        super().__init__()
        self.probes, self.records = probes, records  # probes: storage address -> (name, probe)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # A recording never runs under torch.compile; torch otherwise wraps this mode in dynamo's disable,
        # which imports torch._dynamo (a second or more of every rank's start-up) on its first use.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        touched = [leaf for leaf in tree_leaves((args, kwargs)) if self._probe_name(leaf) is not None]
        name = func.overloadpacket.__name__
        if not touched or name in _VIEWING:
            return func(*args, **kwargs)
        target = args[0] if args else None
        if name.endswith("_") and not name.startswith("_") and self._probe_name(target) is not None:
            self._record(target, name, args[1:], kwargs)
            return target
        for tensor in touched:
            self.records[self._probe_name(tensor)].opaque = True
        return func(*args, **kwargs)

    def _probe_name(self, value: object) -> str | None:
        if not isinstance(value, torch.Tensor) or value.is_meta or value.device.type != "cpu":
            return None
        found = self.probes.get(value.untyped_storage().data_ptr())
        return found[0] if found else None

    def _record(self, target: torch.Tensor, method: str, args: tuple, kwargs: dict) -> None:
        name = self._probe_name(target)
        # Python numbers reach aten as 0-d tensors (``mul_(2.0)``): read back as the numbers they are.
        args = tuple(_as_number(value) for value in args)
        kwargs = {key: _as_number(value) for key, value in kwargs.items() if key != "generator"}
        scalars = all(isinstance(value, (int, float, bool)) or value is None for value in [*args, *kwargs.values()])
        if not scalars or method not in RANDOM_METHODS | ELEMENTWISE_METHODS:
            self.records[name].opaque = True
            return
        self.records[name].ops.append(
            InitOp(method, tuple(args), tuple(sorted(kwargs.items())), _view(target, name, self))
        )


def _as_number(value: object) -> object:
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_meta:
        return value.item()
    return value


def _view(target: torch.Tensor, name: str, recorder: _Recorder) -> View | None:
    probe = recorder.probes[target.untyped_storage().data_ptr()][1]
    if target.storage_offset() == 0 and target.shape == probe.shape and target.stride() == probe.stride():
        return None
    return View(target.storage_offset(), tuple(target.shape), tuple(target.stride()))


def probe_like(tensor: torch.Tensor) -> torch.Tensor:
    """An empty CPU tensor of ``tensor``'s full shape and dtype: address space, not memory, until written."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")


@contextlib.contextmanager
def recording(named_probes: dict[str, torch.Tensor], records: dict[str, RecordedInit]) -> Iterator[None]:
    """Records what runs inside into ``records`` (one RecordedInit per name, created if missing)."""
    for name in named_probes:
        records.setdefault(name, RecordedInit())
    probes = {
        probe.untyped_storage().data_ptr(): (name, probe) for name, probe in named_probes.items() if probe.numel()
    }
    with torch.no_grad(), _Recorder(probes, records):
        yield


def record_declared_init(model: nn.Module, name: str, tensor: torch.Tensor) -> RecordedInit:
    """What the model's ``init_parameter(name, tensor, generator)`` does to the tensor ``name`` (full shape)."""
    records: dict[str, RecordedInit] = {}
    probe = probe_like(tensor)
    with recording({name: probe}, records):
        model.init_parameter(name, probe, None)
    return records[name]


def record_transformers_init(model: nn.Module) -> dict[str, RecordedInit]:
    """What a transformers model's initialisation does to each parameter: each module's ``_init_weights`` is
    that of the nearest model above it (a composite model's parts keep their own, as transformers' own
    ``initialize_weights`` dispatches them)."""
    owners = init_owners(model)
    return record_module_init(model, lambda module: owners[module]._init_weights(module), on=owners.__contains__)


def init_owners(model: nn.Module) -> dict[nn.Module, nn.Module]:
    """Each module -> the nearest module at or above it that defines ``_init_weights`` (a transformers model)."""
    owners: dict[nn.Module, nn.Module] = {}

    def visit(module: nn.Module, owner: nn.Module | None) -> None:
        owner = module if hasattr(module, "_init_weights") else owner
        if owner is not None:
            owners.setdefault(module, owner)
        for child in module.children():
            visit(child, owner)

    visit(model, None)
    return owners


def initialise_whole(model: nn.Module, name: str, *, seed: int) -> torch.Tensor:
    """The parameter ``name`` of a transformers model, initialised for real and whole (what a recording could
    not divide): its module's own parameters materialised at full size on the CPU, then its owner's
    ``_init_weights`` run on them from a generator state seeded by (seed, the module's path)."""
    path, _, _ = name.rpartition(".")
    module = model.get_submodule(path)
    real = {
        key: nn.Parameter(torch.zeros(param.shape, dtype=param.dtype), requires_grad=False)
        for key, param in module._parameters.items()
        if param is not None
    }
    with swapped(module, real), torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed * 1_000_003 + zlib.crc32(path.encode()))
        init_owners(model)[module]._init_weights(module)
    return real[name.rpartition(".")[2]].data


def record_module_init(
    model: nn.Module, init_module: Callable[[nn.Module], None], *, on: Callable[[nn.Module], bool] = lambda _: True
) -> dict[str, RecordedInit]:
    """What ``init_module(module)`` (a transformers model's ``_init_weights``) does to each parameter, module by
    module: each module's own parameters are swapped for probes while it runs, one module at a time. A
    parameter shared by two modules (tied embeddings) has one probe, so both modules' operations land on
    it in order, as they would on the shared tensor.

    Args:
        on: Which modules to run it on (the others are left out).
    """
    names = {id(param): name for name, param in model.named_parameters()}
    owners = collections.Counter(id(param) for module in model.modules() for param in _own(module, names))
    probes: dict[int, nn.Parameter] = {}  # a module's probes live while it runs; a shared one until its last
    records: dict[str, RecordedInit] = {}
    for module in model.modules():
        own = {key: param for key, param in module._parameters.items() if id(param) in names}
        if not own or not on(module):
            continue
        for param in own.values():
            probes.setdefault(id(param), nn.Parameter(probe_like(param), requires_grad=False))
        with swapped(module, {key: probes[id(param)] for key, param in own.items()}):
            with recording({names[id(param)]: probes[id(param)] for param in own.values()}, records):
                init_module(module)
        for param in own.values():
            owners[id(param)] -= 1
            if owners[id(param)] == 0:
                del probes[id(param)]
    return records


def _own(module: nn.Module, names: dict[int, str]) -> list[nn.Parameter]:
    return [param for param in module._parameters.values() if id(param) in names]


@contextlib.contextmanager
def swapped(module: nn.Module, parameters: dict[str, nn.Parameter]) -> Iterator[None]:
    """The module's own parameters replaced by ``parameters`` while inside, put back after."""
    originals = {key: module._parameters[key] for key in parameters}
    module._parameters.update(parameters)
    try:
        yield
    finally:
        module._parameters.update(originals)
