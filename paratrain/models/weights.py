"""What the weight sources of ``models.init`` and ``models.pretrained`` share: the names tensors go by,
and what a source hands back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Wrappers that insert a path component without changing what the parameter is.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """The parameter's name as the model itself spells it, without wrapper path components."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@dataclass(frozen=True)
class LocalPiece:
    """What a source returns when it could read only this rank's slice of a sharded tensor (a pretrained
    file read with ``get_slice``), so no rank holds the full tensor."""

    tensor: torch.Tensor


WeightSource = Callable[[str, torch.Tensor], "torch.Tensor | LocalPiece | None"]
"""The full (unsharded, CPU) tensor of a name, or this rank's LocalPiece of it, given the tensor to fill;
None when the source has no such name."""
