"""Conversations from local files, checked before anything is tokenized.

A row holds either a ``messages`` column (a list of ``{"role", "content"}`` turns) or ``prompt`` and
``completion`` columns (strings: one user turn and the assistant's reply; or lists of turns, TRL's
conversational form). Rows come from ``.jsonl`` files, ``.parquet`` files or 🤗 ``datasets`` saved to disk
(paratrain.data.corpus resolves the paths), in the order given.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from paratrain.data.corpus import jsonl_values
from paratrain.errors import ConfigError

Conversation = list[dict[str, str]]
ROLES_BEFORE_REPLY = ("user", "tool")  # what an assistant turn may answer


def iter_conversations(path: Path) -> Iterator[Conversation]:
    """The conversations of one file or saved dataset, each checked (see check_conversation).

    Raises:
        ConfigError: a row without the columns (the columns it has named), or a conversation out of order.
    """
    for number, row in enumerate(rows_of(path), start=1):
        conversation = conversation_of(row, where=f"{path} row {number}")
        check_conversation(conversation, where=f"{path} row {number}")
        yield conversation


def conversation_of(row: dict[str, Any], *, where: str) -> Conversation:
    """A row's turns, from its ``messages`` or its ``prompt`` and ``completion`` columns."""
    if "messages" in row:
        return list(row["messages"])
    if "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
        return prompt + list(completion)
    raise ConfigError(
        f"data.args.files: {where} has neither a 'messages' column nor 'prompt' and 'completion' columns (it has: "
        f"{', '.join(sorted(row)) or 'none'}); give chat turns as messages=[{{role, content}}, ...] or "
        f"prompt/completion pairs"
    )


def check_conversation(conversation: Conversation, *, where: str) -> None:
    """An optional system turn, then user (or tool) turns each answered by a non-empty assistant reply.

    Raises:
        ConfigError: a malformed turn, turns out of order, an empty reply, or no reply at all.
    """
    previous = None
    for index, turn in enumerate(conversation):
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or "content" not in turn:
            raise ConfigError(f"data.args.files: {where} turn {index} is not a {{role, content}} object: {turn!r}")
        role, content = turn["role"], turn["content"]
        in_order = (
            (role == "system" and index == 0)
            or (role in ROLES_BEFORE_REPLY and previous != "user")
            or (role == "assistant" and previous in ROLES_BEFORE_REPLY)
        )
        if not in_order:
            raise ConfigError(
                f"data.args.files: {where} turn {index} ({role!r} after {previous!r}) is out of order; a conversation "
                f"is an optional system turn, then user turns each followed by an assistant reply"
            )
        if role == "assistant" and not (isinstance(content, str) and content.strip()):
            raise ConfigError(
                f"data.args.files: {where} turn {index} is an empty assistant reply; it would teach nothing: fix or "
                f"drop the row"
            )
        previous = role
    if "assistant" not in (turn["role"] for turn in conversation):
        raise ConfigError(f"data.args.files: {where} has no assistant reply to learn from; fix or drop the row")


def rows_of(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a .jsonl, .parquet or saved dataset, in order."""
    if path.suffix == ".jsonl":
        yield from _jsonl_rows(path)
    elif path.suffix == ".parquet":
        # Lazy: an optional dependency (the data extra), imported only where it is used.
        import pyarrow.parquet as pq

        yield from pq.read_table(path).to_pylist()
    elif path.suffix == ".txt":
        raise ConfigError(f"data.args.files: {path} is plain text; chat data is .jsonl, .parquet or a saved dataset")
    else:
        # Lazy: an optional dependency (the data extra), a second to import, so only for saved datasets.
        import datasets

        yield from datasets.load_from_disk(str(path))


def _jsonl_rows(path: Path) -> Iterator[dict[str, Any]]:
    for number, row in jsonl_values(path):
        if not isinstance(row, dict):
            raise ConfigError(f"data.args.files: {path}:{number} is not a JSON object")
        yield row
