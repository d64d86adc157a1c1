"""Model, data and loss factories named by import path (``package.module:callable``) in the config."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import sysconfig
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from paratrain.config.schema import FactoryConfig
from paratrain.errors import RUN_ENDINGS, ConfigError, UserCodeError

# Frames under these are not the user's: paratrain, the standard library and installed packages (torch,
# transformers), found without importing them.
_PARATRAIN_ROOT = str(Path(__file__).resolve().parent.parent)
_TORCH_ROOT = str(Path(importlib.util.find_spec("torch").origin).parent)
_STDLIB_ROOTS = tuple({sysconfig.get_paths()[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")})


def resolve_factory(path: str, *, key: str) -> Callable[..., Any]:
    """Imports the callable at ``module:attribute``.

    Raises:
        ConfigError: naming ``key`` when the path is malformed, the module does not import or the
            attribute is missing or not callable.
    """
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"{key}={path!r} must look like 'package.module:callable'")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # the user's module may fail in any way while importing
        raise ConfigError(
            f"{key}={path!r}: module {module_name!r} does not import ({type(error).__name__}: {error}); "
            f"check the spelling and that its package is installed or in the working directory"
        ) from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ConfigError(f"{key}={path!r}: module {module_name!r} has no callable {attribute!r}")
    return factory


def check_factory_args(section: FactoryConfig, *, key: str) -> Callable[..., Any]:
    """Resolves the factory and checks ``args`` against its signature, before anything is built."""
    factory = resolve_factory(section.factory, key=f"{key}.factory")
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins expose no signature: their args are checked by the call
        return factory
    try:
        signature.bind(**section.args)
    except TypeError as error:
        accepted = ", ".join(signature.parameters) or "none"
        raise ConfigError(f"{key}.args: {error} for {section.factory}; it accepts: {accepted}") from None
    return factory


def call_factory(section: FactoryConfig, *, key: str) -> Any:
    """Calls ``section.factory(**section.args)``.

    Raises:
        UserCodeError: the factory raised; the message holds its type, message and the user's own frames.
    """
    factory = check_factory_args(section, key=key)
    with reported_as_user_code(f"{key}.factory={section.factory!r}"):
        return factory(**section.args)


@contextlib.contextmanager
def reported_as_user_code(where: str) -> Iterator[None]:
    """What the user's code raises inside, as their code's error (``describe_user_error``: exit code 2, their
    frames, no traceback). paratrain's own run endings (a ConfigError from its factories, a stop) pass as they are:
    they already are a message for the user."""
    try:
        yield
    except RUN_ENDINGS:
        raise
    except Exception as error:
        raise UserCodeError(describe_user_error(where, error)) from error


def describe_user_error(where: str, error: BaseException) -> str:
    """One block: where it happened, the exception, and the frames of the user's code (not paratrain's,
    torch's or the standard library's), innermost last, as a traceback lists them."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if _is_user_frame(frame.filename)]
    lines = [f"{where} raised {type(error).__name__}: {error}"]
    for frame in frames or traceback.extract_tb(error.__traceback__)[-1:]:
        lines.append(f'  File "{frame.filename}", line {frame.lineno}, in {frame.name}')
        if frame.line:
            lines.append(f"    {frame.line}")
    return "\n".join(lines)


def _is_user_frame(filename: str) -> bool:
    library_roots = (_PARATRAIN_ROOT, _TORCH_ROOT, *_STDLIB_ROOTS)
    return not filename.startswith("<") and not any(filename.startswith(root) for root in library_roots)
