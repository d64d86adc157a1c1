"""Which checkpoint files hold which entries: the model's weights in files of their own.

DCP's file writer spreads a rank's entries over its files by size alone (torch 2.13's
``_split_by_size_and_type``), so a file held model weights beside optimizer moments, and reading the model
out of a checkpoint (``paratrain export``) read, and checked, every file. Here each rank writes each group of
entries into files of its own: the model's weights, a LoRA run's adapters, and the rest (optimizer state,
schedule, data position, RNG). An export then reads and hashes the model's files only, and an adapter
export the adapters' files only. A resume reads every file, whatever holds what; DCP finds each entry
through ``.metadata``, so checkpoints written before the split load and export as before.
"""

from __future__ import annotations

import queue
from typing import Literal

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _split_by_size_and_type
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from paratrain.checkpoint.state import MODEL_PREFIX
from paratrain.models.lora import is_adapter

FileGroup = Literal["model", "adapter", "other"]


def file_group(key: str) -> FileGroup:
    """The group of files that holds the checkpoint entry ``key``."""
    if not key.startswith(MODEL_PREFIX):
        return "other"
    return "adapter" if is_adapter(key) else "model"


class GroupedFilesWriter(FileSystemWriter):
    """DCP's file writer with each rank's groups of entries (``file_group``) in files of their own: each group
    split over ``thread_count`` files by size as DCP splits a rank's entries, and no empty file written."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        files: queue.Queue = queue.Queue()
        for number, items in enumerate(self._files_of(plan.items)):
            name = f"{plan.storage_data.prefix}{number}{DEFAULT_SUFFIX}"
            files.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, files)

    def _files_of(self, items: list[WriteItem]) -> list[list[WriteItem]]:
        if not self.single_file_per_rank:
            return [[item] for item in items]
        groups: dict[FileGroup, list[WriteItem]] = {}
        for item in items:
            groups.setdefault(file_group(item.index.fqn), []).append(item)
        split = (_split_by_size_and_type(self.thread_count, group) for group in groups.values())
        return [file for files in split for file in files if file]
