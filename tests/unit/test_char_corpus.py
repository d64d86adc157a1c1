"""The quickstart's corpus (docstrings of the standard library) is parsed once per Python and then read from the
user's cache directory: the same text either way, and a cache that cannot be written changes nothing but the time."""

from __future__ import annotations

import pytest
import torch

from paratrain.data import text


@pytest.fixture
def parsed_only(monkeypatch):
    """Counts the parses; the modules' in-process cache is bypassed, so a parse is a parse."""
    calls = []
    real = text._joined_docstrings

    def counting(max_chars):
        calls.append(max_chars)
        return real(max_chars)

    monkeypatch.setattr(text, "_joined_docstrings", counting)
    return calls


def test_the_corpus_is_parsed_once_then_read_from_the_users_cache_directory(tmp_path, monkeypatch, parsed_only):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)  # the default: ~/.cache
    monkeypatch.setenv("HOME", str(tmp_path))
    first = text.stdlib_docstrings(5000)
    second = text.stdlib_docstrings(5000)
    assert parsed_only == [5000]
    assert first == second == text._joined_docstrings(5000) and len(first) == 5000
    (cached,) = (tmp_path / ".cache" / "paratrain").iterdir()
    assert cached.read_bytes().decode() == first
    assert text.stdlib_docstrings(4000) == first[:4000] and parsed_only[-1] == 4000  # another length, another file


def test_an_unwritable_cache_directory_costs_a_parse_and_nothing_else(tmp_path, monkeypatch, parsed_only):
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # mkdir under a file fails
    assert text.stdlib_docstrings(3000) == text.stdlib_docstrings(3000) == text._joined_docstrings(3000)
    assert parsed_only == [3000, 3000, 3000]


def test_each_character_encodes_as_its_ascii_code_and_any_other_as_one_question_mark():
    sample = (
        "Az ~\n\t\x00\x7f" + "é→😀\udc80"
    )  # four non-ASCII characters: a Latin letter, an arrow, an emoji, a surrogate
    expected = [ord(c) for c in "Az ~\n\t\x00\x7f"] + [ord("?")] * 4
    assert text.encode(sample).tolist() == expected and text.encode(sample).dtype == torch.long
    assert text.encode("").shape == (0,)
