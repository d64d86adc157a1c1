"""Callbacks named in the config by import path, and the check that an object is one."""

from __future__ import annotations

from typing import Any

from paratrain.callbacks.base import HOOKS, Callback
from paratrain.config.factories import check_factory_args, describe_user_error
from paratrain.config.schema import CallbackConfig
from paratrain.errors import ConfigError, UserCodeError


def build_callbacks(configs: list[CallbackConfig], given: list[Any] = ()) -> list[Callback]:
    """The config's callbacks, built in order, then the ones passed to the Trainer.

    Raises:
        ConfigError: naming ``callbacks[i]`` when a factory does not import, does not take or refuses its
            args, or returns an object lacking the hooks.
    """
    built = []
    for index, section in enumerate(configs):
        key = f"callbacks[{index}]"
        factory = check_factory_args(section, key=key)
        try:
            callback = factory(**section.args)
        except (TypeError, ValueError) as error:  # the constructor refusing its args names them
            raise ConfigError(f"{key}.args: {section.factory} refused {section.args}: {error}") from None
        except Exception as error:  # a bug in the user's callback: its frames, not a traceback through paratrain
            raise UserCodeError(describe_user_error(f"{key}.factory={section.factory!r}", error)) from error
        built.append(check_callback(callback, key=f"{key}.factory", origin=section.factory))
    for index, callback in enumerate(given):
        built.append(check_callback(callback, key=f"Trainer(callbacks=[...])[{index}]", origin=type(callback).__name__))
    return built


def check_callback_configs(configs: list[CallbackConfig]) -> None:
    """What preflight can check without building anything: each path imports, takes its args, and (for a
    class) has every hook; every problem at once. A factory function's result is checked when the Trainer
    builds it."""
    problems = []
    for index, section in enumerate(configs):
        try:
            factory = check_factory_args(section, key=f"callbacks[{index}]")
            if isinstance(factory, type):
                check_callback(factory, key=f"callbacks[{index}].factory", origin=section.factory)
        except ConfigError as error:
            problems.append(str(error))
    if problems:
        raise ConfigError("\n".join(problems))


def check_callback(callback: Any, *, key: str, origin: str) -> Any:
    missing = [hook for hook in HOOKS if not callable(getattr(callback, hook, None))]
    if missing:
        raise ConfigError(
            f"{key}={origin!r} is not a callback: it lacks {', '.join(missing)}; subclass "
            f"paratrain.callbacks.Callback (its hooks do nothing until overridden)"
        )
    return callback
