"""The config reference, rendered from the schema itself so the docs cannot drift from it.

``python -m paratrain.config.docs`` writes the whole page, docs/reference/config.md; a test checks that the
checked-in page is exactly what this renders.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

from paratrain.config.schema import Config

PAGE = Path("docs/reference/config.md")  # relative to the repository root
REGENERATE = "python -m paratrain.config.docs"
HEADER = f"""# Config reference

<!-- Generated from paratrain/config/schema.py by `{REGENERATE}`: edit the field docstrings there, not this file. -->

You want to know what a key does, its type or its default. Every key of the config, with the default it
takes when neither the YAML file nor a `key=value` override sets it; `paratrain config show CONFIG
[overrides]` prints the values a run would use. Unknown keys are refused, naming the key.
"""


def render_reference() -> str:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    rows += [_row(key, field, default) for key, field, default in _leaf_fields(Config, Config(), prefix="")]
    return "\n".join(rows)


def _leaf_fields(model: type[BaseModel], defaults: BaseModel, *, prefix: str):
    for name, field in model.model_fields.items():
        value = getattr(defaults, name)
        section = _optional_section(field.annotation)
        if isinstance(value, BaseModel):
            yield from _leaf_fields(type(value), value, prefix=f"{prefix}{name}.")
        elif section is not None:  # a section that is off (null) unless given: its row, then its keys
            yield f"{prefix}{name}", field, value
            for key, inner in section.model_fields.items():
                default = "required" if inner.is_required() else inner.default
                yield f"{prefix}{name}.{key}", inner, default
        else:
            yield f"{prefix}{name}", field, value


def _optional_section(annotation: Any) -> type[BaseModel] | None:
    """X for an annotation ``X | None`` where X is a config section, else None."""
    sections = [arg for arg in get_args(annotation) if isinstance(arg, type) and issubclass(arg, BaseModel)]
    return sections[0] if len(sections) == 1 and type(None) in get_args(annotation) else None


def _row(key: str, field: Any, default: Any) -> str:
    kind = _type_name(field.annotation)
    description = " ".join((field.description or "").split()).replace("|", "\\|")
    return f"| `{key}` | {kind} | `{_default_text(default)}` | {description} |"


def _type_name(annotation: Any) -> str:
    if _optional_section(annotation) is not None:
        return "section or None"
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(f"`{choice}`" for choice in get_args(annotation))
    words = [arg for arg in get_args(annotation) if get_origin(arg) is Literal]
    if (
        words and get_origin(annotation) is Union and type(None) not in get_args(annotation)
    ):  # ``int | Literal["auto"]``
        others = [_type_name(arg) for arg in get_args(annotation) if arg not in words]
        return " or ".join([*others, *(f"`{word}`" for arg in words for word in get_args(arg))])
    if get_args(annotation):
        return str(annotation).replace("typing.", "").replace("NoneType", "None").replace("|", "or")
    return annotation.__name__


def _default_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, tuple):
        value = list(value)
    return str(value)


def render_page() -> str:
    """The whole reference page: a short header, then one table row per config key."""
    return f"{HEADER}\n{render_reference()}\n"


if __name__ == "__main__":
    # Run from the repository root; an argument writes the page elsewhere (to compare, say).
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else PAGE
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render_page())
