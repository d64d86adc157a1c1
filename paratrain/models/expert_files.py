"""Stacked experts as transformers' files hold them: one tensor per expert and projection.

transformers 5 computes a family's experts from stacked parameters (``mlp.experts.gate_up_proj``
``(experts, 2 * intermediate, hidden)``, ``mlp.experts.down_proj`` ``(experts, hidden, intermediate)``) but
``save_pretrained`` writes them, and the Hub's checkpoints hold them, as before: per expert
(``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``; Mixtral's
``block_sparse_moe.experts.{e}.w1``/``w3``/``w2``), converted when ``from_pretrained`` loads. paratrain
reads a rank's experts from those tensors (``model.pretrained``, under any layout) and ``export --hf`` writes
them back the same way, so a model goes in and comes out in the layout transformers saves.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator

import torch

# The stacked parameter's name -> the tensors of one expert, concatenated along dim 0 (gate before up).
_PARTS = {
    "gate_up_proj": {"mlp": ("gate_proj.weight", "up_proj.weight"), "block_sparse_moe": ("w1.weight", "w3.weight")},
    "down_proj": {"mlp": ("down_proj.weight",), "block_sparse_moe": ("w2.weight",)},
}
# Each family's files: where its experts live in a block, as save_pretrained writes them.
FILE_STYLE = {"MixtralForCausalLM": "block_sparse_moe"}
DEFAULT_STYLE = "mlp"


def per_expert_names(name: str, *, num_experts: int, style: str) -> list[list[str]] | None:
    """The file tensors of each expert of the stacked parameter ``name`` (``[expert][part]``) in the files of
    ``style`` (``mlp`` or ``block_sparse_moe``), or None when ``name`` is no stacked expert parameter."""
    prefix, _, leaf = name.rpartition(".")
    if leaf not in _PARTS or not prefix.endswith(".mlp.experts"):
        return None
    base = prefix.removesuffix(".mlp.experts") + f".{style}.experts"
    return [[f"{base}.{expert}.{part}" for part in _PARTS[leaf][style]] for expert in range(num_experts)]


def find_per_expert_names(name: str, *, num_experts: int, available: Collection[str]) -> list[list[str]] | None:
    """``per_expert_names`` in whichever style the files (``available`` names) hold, or None."""
    for style in _PARTS["down_proj"]:
        names = per_expert_names(name, num_experts=num_experts, style=style)
        if names is not None and all(part in available for parts in names for part in parts):
            return names
    return None


def read_stacked(names: list[list[str]], experts: range, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The stacked tensor of ``experts`` (a range of the stacked dim 0), each expert's parts read with ``read``
    and concatenated along their dim 0."""
    return torch.stack([torch.cat([read(part) for part in names[expert]]) for expert in experts])


def split_stacked(names: list[list[str]], tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The file tensors of a whole stacked ``tensor``, in ``names``' order: each expert's slice cut into its
    parts (equal along dim 0)."""
    for expert, parts in enumerate(names):
        for index, piece in enumerate(tensor[expert].chunk(len(parts))):
            yield parts[index], piece
