"""Factories with the user's own bugs, for test_user_code_errors."""

from torch import nn

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


class _ScaledLinear(nn.Module):
    """A model whose bug shows only on real values: on the meta device (the shape check) it cannot run."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(128, 8)
        self.head = nn.Linear(8, 128)

    def forward(self, tokens):
        hidden = self.embed(tokens)
        return self.head(hidden / _norm(hidden))


def _norm(hidden):
    if hidden.abs().max().item() > 0:
        raise RuntimeError("normalising by the wrong axis")
    return hidden


def model_with_a_forward_bug(**model_args):
    return _ScaledLinear()


def broken_callback():
    return _callbacks_registry()["progress"]


def _callbacks_registry():
    raise LookupError("no callback registry configured")
