"""Model, data and loss factories named by import path (``package.module:callable``) in the config."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from paratrain.config.schema import FactoryConfig
from paratrain.errors import ConfigError


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
    return check_factory_args(section, key=key)(**section.args)
