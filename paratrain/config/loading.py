"""How the config is loaded: one precedence chain, schema defaults < YAML file < ``dotted.key=value``
overrides. Unknown keys are rejected and every error is reported at once, each with its dotted path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from paratrain.config.schema import Config
from paratrain.errors import ConfigError


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Builds the config from defaults, an optional YAML file and ``key.sub=value`` overrides.

    Raises:
        ConfigError: the file is missing or not YAML, an override is malformed, or validation fails
            (all validation errors listed, each with its dotted key).
    """
    raw = _read_yaml(Path(path)) if path is not None else {}
    for override in overrides:
        key, value = _parse_override(override)
        _set_dotted(raw, key, value)
    return validate_config(raw)


def validate_config(raw: dict[str, Any]) -> Config:
    """Validates a plain dict against the schema, reporting every problem at once."""
    try:
        return Config.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(_format_validation_errors(error)) from None


def config_to_yaml(config: Config) -> str:
    """The fully resolved config as YAML that load_config reads back to the same Config."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def _read_yaml(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; pass the path of a YAML config file inside it")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass the path of a YAML config")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {error.start} is {error.object[error.start]:#04x}); "
            f"save it as UTF-8"
        ) from None
    try:
        loaded = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, not {type(loaded).__name__}")
    return loaded


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping: PyYAML keeps the last silently, so
    the first value, the one a reader sees, would not be the one that trains."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} on lines {seen[key]} and {line}; keep one", key_node.start_mark
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _parse_override(override: str) -> tuple[str, Any]:
    key, sep, text = override.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {override!r} must look like section.key=value (e.g. train.max_steps=100)")
    # YAML parsing gives overrides the same typing as the file: 3 -> int, null -> None, [1,2] -> list.
    return key, yaml.safe_load(text) if text else ""


def _set_dotted(tree: dict[str, Any], dotted_key: str, value: Any) -> None:
    *parents, leaf = dotted_key.split(".")
    node = tree
    for index, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            prefix = ".".join(parents[: index + 1])
            raise ConfigError(f"override {dotted_key}: {prefix} is a value, not a section")
        node = child
    node[leaf] = value


def flatten_dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value, the inverse of overrides' ``section.key=value``: {"optim": {"lr": 1}} ->
    {"optim.lr": 1}. Nested dicts (sections, factory args) are walked; an empty one adds nothing."""
    flat: dict[str, Any] = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten_dotted(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def _format_validation_errors(error: ValidationError) -> str:
    lines = [f"invalid config ({error.error_count()} problem{'s' if error.error_count() > 1 else ''}):"]
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(root)"
        lines.append(f"  {key}: {_describe(item)}")
    return "\n".join(lines)


def _describe(item: dict[str, Any]) -> str:
    if item["type"] == "extra_forbidden":
        return "unknown key; remove it or fix its spelling (valid keys: docs/reference/config.md)"
    message = item["msg"].removeprefix("Value error, ")
    if item["type"] in ("value_error", "assertion_error"):
        return message
    return f"{message} (got {item.get('input')!r})"
