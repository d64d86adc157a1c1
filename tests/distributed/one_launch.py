"""Shared by the counting scripts run under torchrun: several configurations in one launch."""

import json
from collections.abc import Callable, Iterable

import torch.distributed as dist


def count_each(count: Callable[[object], dict], keys: Iterable, out_path: str) -> None:
    """Runs count(key) for each key in turn in these processes, and writes {key: counts} as JSON from
    rank 0. The script owns the process group: each Trainer joins it and leaves it open at close()."""
    dist.init_process_group("gloo")
    counts = {key: count(key) for key in keys}
    if dist.get_rank() == 0:
        with open(out_path, "w") as handle:
            json.dump(counts, handle)
    dist.destroy_process_group()
