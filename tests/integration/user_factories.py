"""Factories with the user's own bugs, for test_user_code_errors."""

from paratrain.data.text import build_char_dataset


def _check_width(width):
    if width % 7:
        raise ValueError(f"width {width} is not a multiple of 7")


def broken_model(width: int = 32, **model_args):
    _check_width(width)


def broken_data(block_size: int = 16, max_chars: int = 2_000):
    dataset = build_char_dataset(block_size=block_size, max_chars=max_chars)
    return dataset.no_such_attribute


def broken_loss():
    return {}["cross_entropy"]
