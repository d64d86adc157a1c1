"""Shared by the counting scripts run under torchrun: several configurations in one launch."""

import json
import os
from collections.abc import Callable, Iterable


def count_each(count: Callable[[object], dict], keys: Iterable, out_path: str) -> None:
    """Runs count(key) for each key in turn in these processes (each Trainer joins the process group
    again after the previous one closed it), and writes {key: counts} as JSON from rank 0."""
    counts = {key: count(key) for key in keys}
    if int(os.environ["RANK"]) == 0:
        with open(out_path, "w") as handle:
            json.dump(counts, handle)
