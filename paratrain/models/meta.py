"""Building a model on the meta device, quickly.

Under ``torch.device("meta")`` a module's constructor still runs its initialisers (``nn.init.normal_``
and friends) on the meta tensors. They have no data, so that work fills nothing, but the meta kernels
of the random initialisers are Python references wrapped to disable dynamo, and the first call imports
``torch._dynamo``: about 0.4-0.7 s, paid by the launcher's preflight before any worker starts.
Skipping ``torch.nn.init`` calls on meta tensors changes nothing else: a meta tensor holds no values and
its initialisation draws nothing from the random generators.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# Where initialisers live: torch's, and transformers' own wrappers of them (transformers 5 dispatches its
# ``transformers.initialization.normal_`` and friends through torch functions too; under this mode torch's
# inside them would no longer be seen, and each draw on a meta tensor costs a millisecond of meta kernel).
INIT_MODULES = frozenset({"torch.nn.init", "transformers.initialization"})


class _SkipInitOfMetaTensors(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) in INIT_MODULES:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """``torch.device("meta")`` for building a model, without running initialisers on its meta tensors."""
    with torch.device("meta"), skipping_init_of_meta_tensors():
        yield


def skipping_init_of_meta_tensors() -> TorchFunctionMode:
    """Leaves out ``torch.nn.init`` calls on meta tensors (a build whose parameters go to meta as they are
    registered runs its initialisers on them too)."""
    return _SkipInitOfMetaTensors()


def maybe_build_on_meta(factory: Callable[[], nn.Module]) -> nn.Module | None:
    """The factory's model on meta for a check that only reads shapes, or None when the factory cannot
    build there (its real build, which comes next, reports its own errors)."""
    try:
        with on_meta():
            return factory()
    except Exception:  # noqa: BLE001 - a user factory may fail in any way on meta tensors
        return None


def build_with_parameters_on_meta(factory: Callable[[], nn.Module], *, larger_than: int = -1) -> nn.Module:
    """The factory's model built on the CPU with its parameters larger than ``larger_than`` numbers (all, by
    default) moved to meta as they are registered, as Accelerate's ``init_empty_weights`` does: real
    buffers (rotary frequencies), and no large parameter ever allocated or drawn."""
    with _parameters_on_meta(larger_than=larger_than), torch.device("cpu"), skipping_init_of_meta_tensors():
        return factory()


def real_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers that hold values (not on meta), by name."""
    return {name: tensor for name, tensor in [*model.named_parameters(), *model.named_buffers()] if not tensor.is_meta}


@contextlib.contextmanager
def _parameters_on_meta(*, larger_than: int) -> Iterator[None]:
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.numel() > larger_than:
            kind, kwargs = type(param), param.__dict__
            module._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name].__dict__.update(kwargs)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
