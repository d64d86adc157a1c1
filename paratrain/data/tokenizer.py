"""Loading a Hugging Face tokenizer (a ``tokenizer.json`` or a directory holding one) and its EOS token."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from paratrain.errors import ConfigError

# Tried in order when neither data.args.eos_token nor tokenizer_config.json names the EOS token.
COMMON_EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


@dataclass(frozen=True)
class LoadedTokenizer:
    """A ``tokenizers.Tokenizer``, the id documents are separated by, and a digest of its definition."""

    tokenizer: object  # tokenizers.Tokenizer (imported lazily: the data extra)
    eos_id: int
    vocab_size: int
    digest: str


def tokenizer_file(path: str | Path, *, key: str = "data.args.tokenizer") -> Path:
    """The ``tokenizer.json`` that ``path`` names (itself, or inside the directory)."""
    path = Path(path).expanduser()
    candidate = path / "tokenizer.json" if path.is_dir() else path
    if not candidate.is_file():
        raise ConfigError(
            f"{key}={str(path)!r} is not a tokenizer: no such file or no tokenizer.json in the directory; give a "
            f"tokenizer.json or the directory a Hugging Face tokenizer was saved to"
        )
    return candidate


def load_tokenizer(
    path: str | Path, *, eos_token: str | None = None, key: str = "data.args.tokenizer"
) -> LoadedTokenizer:
    """Loads the tokenizer and finds its EOS id.

    Raises:
        ConfigError: the path is not a tokenizer, or no EOS token can be found in it.
    """
    # Lazy: an optional dependency, imported only where it is used.
    from tokenizers import Tokenizer  # the data extra

    file = tokenizer_file(path, key=key)
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as error:  # tokenizers raises a bare Exception for any malformed file
        raise ConfigError(
            f"{key}={str(path)!r} is not a tokenizer ({error}); give a tokenizer.json saved by the tokenizers or "
            f"transformers library"
        ) from None
    eos = (
        eos_token
        or _configured_eos(file.parent)
        or next((name for name in COMMON_EOS_TOKENS if tokenizer.token_to_id(name) is not None), None)
    )
    eos_id = tokenizer.token_to_id(eos) if eos else None
    if eos_id is None:
        raise ConfigError(
            f"data.args.eos_token={eos!r}: tokenizer {file} has no such token to separate documents with; name one "
            f"of its tokens as data.args.eos_token"
        )
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    return LoadedTokenizer(tokenizer, eos_id, tokenizer.get_vocab_size(with_added_tokens=True), digest)


def _configured_eos(directory: Path) -> str | None:
    """eos_token from a transformers ``tokenizer_config.json`` beside the tokenizer, if there is one."""
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return None
    eos = json.loads(config.read_text()).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos
