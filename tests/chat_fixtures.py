"""A word-level tokenizer with a chat template, trained on nothing (its vocabulary is listed), and small
chat datasets of conversations with prompts and replies of different lengths."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = "one two three four five six seven eight nine ten hello hi how are you fine thanks what is plus".split()
SPECIAL = ["<pad>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]
# Renders each turn after the previous ones: replies are found by rendering prefixes.
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
# The same rendering, with transformers' generation markers around each reply.
MARKED_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|> {% generation %}{{ m.content }} <|end|>"
    "{% endgeneration %} {% else %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def write_chat_tokenizer(directory: Path, *, template: str | None = TEMPLATE) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(SPECIAL + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(directory)
    return directory


def conversation(index: int) -> list[dict[str, str]]:
    """Conversation ``index``: 1 or 2 exchanges, prompts of 1 to 9 words and replies of 1 to 4."""

    def words(count: int, offset: int) -> str:
        return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(count))

    turns = [{"role": "system", "content": "hi"}] if index % 3 == 0 else []
    for exchange in range(1 + index % 2):
        turns.append({"role": "user", "content": words(1 + (index * 5 + exchange) % 9, index)})
        turns.append({"role": "assistant", "content": words(1 + (index + exchange) % 4, index + 3)})
    return turns


def write_chat_jsonl(path: Path, count: int, *, columns: str = "messages") -> Path:
    rows = [conversation(index) for index in range(count)]
    if columns == "prompt/completion":
        rows = [{"prompt": turns[-2]["content"], "completion": turns[-1]["content"]} for turns in rows]
    else:
        rows = [{"messages": turns} for turns in rows]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def preference_row(index: int, *, conversational: bool = True) -> dict:
    """Preference row ``index``: a prompt and two different replies of 1 to 4 words (TRL's column names)."""

    def words(count: int, offset: int) -> str:
        return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(count))

    prompt = words(1 + (index * 5) % 7, index)
    chosen, rejected = words(1 + index % 4, index + 2), words(1 + (index + 1) % 4, index + 9)
    if not conversational:
        return {"prompt": prompt + " ", "chosen": chosen, "rejected": rejected}
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


def write_preference_jsonl(path: Path, count: int, *, conversational: bool = True) -> Path:
    rows = [preference_row(index, conversational=conversational) for index in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
