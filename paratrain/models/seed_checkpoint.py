"""A seed checkpoint: the initial weights of a model paratrain cannot initialise piecewise (a plain
``nn.Module``, whose constructor is its initialisation), built for real once, by one process, exactly as
``single`` builds it, and written as safetensors that every rank then reads its slices from.

Only rank 0 builds it, so only rank 0 holds the whole model, once; the others wait. The file goes into the
run's output directory (storage every rank reaches, as checkpoints need) and is removed once every rank
has read its part.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from paratrain.errors import ConfigError

logger = logging.getLogger("paratrain")

FILE = "model.safetensors"


@contextlib.contextmanager
def seed_checkpoint(factory: Callable[[], nn.Module], *, seed: int, directory: Path | None) -> Iterator[Path]:
    """Yields the directory of the seed checkpoint of ``factory``'s model (built after ``manual_seed(seed)``),
    written by rank 0 while the other ranks wait, and removed after every rank is done with it.

    Args:
        directory: Where to write it, on storage every rank reaches; None in one process without a group
            (a temporary directory then).
    """
    rank = dist.get_rank() if _distributed() else 0
    if directory is None and _distributed():
        raise ConfigError("model: a seed checkpoint needs a directory every rank reaches (run.output_dir)")
    with contextlib.ExitStack() as stack:
        root = directory if directory is not None else Path(stack.enter_context(_temporary()))
        path = root / f"seed-checkpoint-{seed}"
        if rank == 0:
            _write(factory, seed=seed, path=path)
        _barrier()
        try:
            yield path
        finally:
            _barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)


def _write(factory: Callable[[], nn.Module], *, seed: int, path: Path) -> None:
    # lazy: safetensors, only for the runs that write a seed checkpoint
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = factory()
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    logger.info(
        "weights: %s declares no init_parameter and is not a transformers model, so its constructor is its "
        "initialisation: built once here (%.2f GiB, rank 0 only) and written as a seed checkpoint every rank "
        "reads its slices from",
        type(model).__name__,
        size,
    )
    tensors = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    path.mkdir(parents=True, exist_ok=True)
    partial = path / (FILE + ".partial")
    save_file(_without_shared_storage(tensors), partial)
    partial.rename(path / FILE)  # complete: no rank reads a file being written


def _without_shared_storage(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One name per storage (a tied weight is saved once, under its first name): safetensors refuses shared ones."""
    seen, kept = set(), {}
    for name, tensor in tensors.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            kept[name] = tensor
    return kept


@contextlib.contextmanager
def _temporary() -> Iterator[str]:
    # lazy: only a one-process run without a directory uses one
    import tempfile

    with tempfile.TemporaryDirectory(prefix="paratrain-seed-") as directory:
        yield directory


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()
