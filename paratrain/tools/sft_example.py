"""The fine-tuning example's inputs, made locally in seconds: nothing is downloaded.

``python -m paratrain.tools.sft_example DIR`` writes
- ``DIR/chat.jsonl``: small arithmetic conversations ("what is three plus four" -> "seven"), some with a
  system turn and a second exchange;
- ``DIR/preference.jsonl``: preference rows in TRL's columns for DPO: a sum as the prompt, the right answer
  chosen and a wrong one rejected;
- ``DIR/tokenizer``: a word-level tokenizer over their words, with a chat template, saved by transformers;
- ``DIR/base``: a tiny Llama made from its config (random weights), saved with ``save_pretrained``: the
  stand-in for the pretrained model a user would download.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NUMBERS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen".split()
)
WORDS = [*NUMBERS, "what", "is", "plus", "and", "you", "answer", "with", "a", "number"]
SPECIAL = ["<pad>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def conversations(count: int, *, seed: int = 0) -> list[list[dict[str, str]]]:
    """Sums of two numbers up to eight, one or two exchanges each, a system turn in every third."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        turns = [{"role": "system", "content": "answer with a number"}] if index % 3 == 0 else []
        for _ in range(1 + index % 2):
            a, b = rng.randint(0, 8), rng.randint(0, 8)
            turns.append({"role": "user", "content": f"what is {NUMBERS[a]} plus {NUMBERS[b]}"})
            turns.append({"role": "assistant", "content": NUMBERS[a + b]})
        rows.append(turns)
    return rows


def preferences(count: int, *, seed: int = 1) -> list[dict]:
    """A sum of two numbers up to eight; the right answer chosen, one off by one or two rejected."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 8), rng.randint(0, 8)
        wrong = rng.choice([n for n in (a + b - 2, a + b - 1, a + b + 1, a + b + 2) if 0 <= n < len(NUMBERS)])
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"what is {NUMBERS[a]} plus {NUMBERS[b]}"}],
                "chosen": [{"role": "assistant", "content": NUMBERS[a + b]}],
                "rejected": [{"role": "assistant", "content": NUMBERS[wrong]}],
            }
        )
    return rows


def write_tokenizer(directory: Path) -> int:
    """Saves the tokenizer; returns its vocabulary size."""
    # Lazy: the hf and data extras, only for this command.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(SPECIAL + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(directory)
    return len(vocab)


def write_base_model(directory: Path, *, vocab_size: int, seed: int = 0) -> None:
    # Lazy: torch and the hf extra are loaded only when the base model is written, not for --help.
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model("llama", vocab_size=vocab_size, **LLAMA)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--conversations", type=int, default=512)
    args = parser.parse_args()
    args.directory.mkdir(parents=True, exist_ok=True)
    rows = conversations(args.conversations)
    (args.directory / "chat.jsonl").write_text("".join(json.dumps({"messages": turns}) + "\n" for turns in rows))
    pairs = preferences(args.conversations)
    (args.directory / "preference.jsonl").write_text("".join(json.dumps(row) + "\n" for row in pairs))
    vocab_size = write_tokenizer(args.directory / "tokenizer")
    write_base_model(args.directory / "base", vocab_size=vocab_size)
    print(
        f"wrote {len(rows)} conversations, {len(pairs)} preference rows, a tokenizer and a base model to {args.directory}"
    )


if __name__ == "__main__":
    main()
