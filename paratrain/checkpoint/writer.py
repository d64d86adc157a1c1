"""Saving a checkpoint under ``output_dir/checkpoints/step-<N>``.

A save is synchronous, or asynchronous through DCP's ``async_save``: the state is copied to CPU
memory before the call returns (training may then change it), and a background thread writes the
copy, waits for every rank to finish writing, and only then has rank 0 write the manifest that makes
the checkpoint complete. At most one save is in flight: each save, the end of training and a
preemption stop first wait for the previous one. A crash mid-write leaves no manifest, so the
previous complete checkpoint stays the newest one ``resume: auto`` finds.

When the storage refuses a save (disk full, quota, read-only, permissions), every rank raises
``CheckpointWriteError`` together, after rank 0 removed the incomplete directory and said which
complete checkpoint a resume continues from.
"""

from __future__ import annotations

import logging
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful

from paratrain.checkpoint.hashing import HashingWriter
from paratrain.checkpoint.manifest import write_manifest
from paratrain.checkpoint.rotation import Rotation
from paratrain.checkpoint.save_planner import EqualValuesOncePlanner
from paratrain.checkpoint.selection import newest_complete
from paratrain.checkpoint.storage_errors import SAVE_FAILURES, find_storage_error, storage_fix
from paratrain.errors import CheckpointWriteError
from paratrain.launch import faults
from paratrain.parallel.collectives import all_gather_object, broadcast_object, is_distributed, quiet_single_process

logger = logging.getLogger(__name__)


class CheckpointWriter:
    """Writes step-<N> directories with DCP, marks them complete, and rotates old ones out.

    Args:
        directory: The run's ``checkpoints/`` directory, on storage every rank can reach.
        keep_last: Complete checkpoints to keep, or None for all.
        rank: This process's global rank; rank 0 marks completion and rotates.
        world_size: Recorded in each manifest.
        config: The resolved config, recorded in each manifest.
        async_save: Allow ``save(..., blocking=False)``; every rank must pass the same value, since
            it creates a process group of its own for the background writes.
        device: The run's device; async staging buffers are pinned when it is a GPU.
    """

    def __init__(
        self,
        directory: Path,
        *,
        keep_last: int | None,
        rank: int,
        world_size: int,
        config: dict[str, Any],
        async_save: bool = False,
        device: torch.device = torch.device("cpu"),
    ):
        self.directory = directory
        self.rank = rank
        self.world_size = world_size
        self.config = config
        self.async_save = async_save
        # Background writes synchronise ranks on a gloo group of their own: collectives issued from
        # two threads on one group would interleave with training's and hang (and DCP's async_save
        # refuses a group without a CPU backend, such as NCCL alone).
        self._group = dist.new_group(backend="gloo") if async_save and is_distributed() else None
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="paratrain-checkpoint") if async_save else None
        )
        self._stager = _build_stager(device) if async_save else None
        self._in_flight: _InFlightSave | None = None
        self.rotation = Rotation(directory, keep_last=keep_last)  # rank 0's
        if async_save and not is_distributed():
            # A lone process saves without a group on purpose; DCP says so from its own thread, where
            # quiet_single_process cannot reach.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    def save(
        self, step: int, state: dict[str, Stateful], *, blocking: bool = True, weights_finite: bool | None = None
    ) -> Path:
        """Writes ``step-<step>``; returns its path. Every rank calls it at the same step.

        With ``blocking=False`` (needs ``async_save``) it returns once the state is copied to CPU
        memory; the checkpoint is complete only after ``wait()``. Either way a save still in flight
        is waited for first. ``weights_finite`` (the caller's check of every rank's weights) goes into the
        manifest; ``resume: auto`` never picks a checkpoint recorded as not finite.
        """
        self.wait()
        self.rotation.wait()  # a rotated-out checkpoint's space is free before this one is written
        path = self.directory / f"step-{step}"
        try:
            self._fresh_directory(path)
            if blocking or not self.async_save:
                self._save_now(path, step, state, weights_finite=weights_finite)
            else:
                self._start_async_save(path, step, state, weights_finite=weights_finite)
        except SAVE_FAILURES as error:
            self._maybe_stop_on_storage_error(error, step=step, path=path)
            raise
        return path

    def _save_now(self, path: Path, step: int, state: dict[str, Stateful], *, weights_finite: bool | None) -> None:
        writer = HashingWriter(path)
        with quiet_single_process():
            dcp.save(state, storage_writer=writer, planner=EqualValuesOncePlanner(), no_dist=not is_distributed())
        faults.maybe_kill("mid_save", step=step, rank=self.rank)
        self._mark_complete(path, step=step, group=None, weights_finite=weights_finite, hashed=writer.written)

    def _start_async_save(
        self, path: Path, step: int, state: dict[str, Stateful], *, weights_finite: bool | None
    ) -> None:
        started = time.perf_counter()
        writer = HashingWriter(path)
        with quiet_single_process():
            written = dcp.async_save(
                state,
                storage_writer=writer,
                planner=EqualValuesOncePlanner(),
                process_group=self._group,
                async_stager=self._stager,
                no_dist=not is_distributed(),
            )
        faults.maybe_kill("mid_async_save", step=step, rank=self.rank)
        assert self._executor is not None
        done = self._executor.submit(self._finish_async, written, writer, path, step, started, weights_finite)
        self._in_flight = _InFlightSave(step, path, done)

    def wait(self) -> Path | None:
        """Blocks until the save in flight, if any, is complete on every rank; returns its path.

        Raises:
            CheckpointWriteError: the storage refused the background write (on every rank).
            Exception: whatever else failed in the background write, so a lost checkpoint is not silent.
        """
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return None
        if not in_flight.done.done():
            logger.info("waiting for checkpoint %s, still being written in the background", in_flight.path)
        try:
            in_flight.done.result()
        except SAVE_FAILURES as error:
            self._maybe_stop_on_storage_error(error, step=in_flight.step, path=in_flight.path)
            raise
        return in_flight.path

    def close(self) -> None:
        """Waits for the save in flight and stops the background thread."""
        try:
            self.wait()
        finally:
            self.rotation.wait()
            if self._executor is not None:
                self._executor.shutdown()
            if self._stager is not None:
                self._stager.close()

    def _fresh_directory(self, path: Path) -> None:
        def recreate() -> None:
            # DCP must write into a fresh directory; a leftover from a crashed attempt is not trusted.
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)

        self._on_main(recreate, group=None)

    def _on_main(self, action: Callable[[], None], *, group: dist.ProcessGroup | None) -> None:
        """Runs action on rank 0 while the others wait; an OSError it raises is raised on every rank, so
        none is left waiting for rank 0 in a collective."""
        failed = None
        if self.rank == 0:
            try:
                action()
            except OSError as error:
                failed = OSError(error.errno, error.strerror, error.filename)  # pickles with its errno
        failed = broadcast_object(failed, group=group)
        if failed is not None:
            raise failed

    def _maybe_stop_on_storage_error(self, error: BaseException, *, step: int, path: Path) -> None:
        """Raises CheckpointWriteError on every rank when the storage refused the save; returns (for the
        caller to re-raise ``error``) when something else failed. Every rank calls it with the same error:
        DCP and _on_main hand each rank every rank's failure."""
        failure = self._describe_storage_failure(error, step=step, path=path) if self.rank == 0 else None
        # Rank 0 has removed the directory and said what happened before any rank goes on to exit.
        failure = broadcast_object(failure)
        if failure is not None:
            raise CheckpointWriteError(**failure) from error

    def _describe_storage_failure(self, error: BaseException, *, step: int, path: Path) -> dict[str, Any] | None:
        refused = find_storage_error(error)
        if refused is None:
            return None
        # No manifest was written, so nothing would resume from it; removed anyway, for the space.
        shutil.rmtree(path, ignore_errors=True)
        failure = {
            "step": step,
            "path": Path(refused.filename) if refused.filename else path,
            "errno": refused.errno,
            "checkpoint": newest_complete(self.directory),
            "fix": storage_fix(refused.errno),
        }
        logger.error("error: %s", CheckpointWriteError(**failure))
        return failure

    def _finish_async(
        self,
        written: Future,
        writer: HashingWriter,
        path: Path,
        step: int,
        started: float,
        weights_finite: bool | None,
    ) -> None:
        """In the background thread: waits for DCP's write, then marks the checkpoint complete."""
        written.result()
        faults.maybe_slow_down("slow_async_save", step=step, rank=self.rank)
        self._mark_complete(path, step=step, group=self._group, weights_finite=weights_finite, hashed=writer.written)
        logger.info("checkpoint %s written in the background in %.2f s", path, time.perf_counter() - started)

    def _mark_complete(
        self,
        path: Path,
        *,
        step: int,
        group: dist.ProcessGroup | None,
        weights_finite: bool | None,
        hashed: dict[str, dict[str, Any]],
    ) -> None:
        """``hashed``: this rank's files as its writer hashed them; rank 0 lists every rank's."""
        # Every rank's data is on disk (DCP synced each file) before rank 0 declares the checkpoint complete.
        every_rank = all_gather_object(hashed, group=group)
        all_hashed = {name: entry for rank_files in every_rank for name, entry in rank_files.items()}

        def declare_complete() -> None:
            write_manifest(
                path,
                step=step,
                config=self.config,
                world_size=self.world_size,
                weights_finite=weights_finite,
                hashed=all_hashed,
            )
            self.rotation.rotate()

        self._on_main(declare_complete, group=group)


def staging_pins_memory(device: torch.device) -> bool:
    """Pinned staging buffers only when the run's state lives on a GPU (fast device-to-host
    copies); a CPU run on a machine that has a GPU would only lock host memory for nothing."""
    return device.type == "cuda"


def _build_stager(device: torch.device) -> DefaultStager:
    """Copies the state into CPU buffers kept from one save to the next (pinned when the run is on
    a GPU): a fresh allocation per save made staging a 315 MB state take 0.4 s instead of 0.1 s
    (docs/benchmarks.md). Reuse is safe because a save stages only once the previous one is written.
    The cost: each rank holds a host copy of its own shard of the state (model, optimizer) for the
    whole run, pinned on GPU runs (page-locked memory the OS cannot swap)."""
    pinned = staging_pins_memory(device)
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
        )
    )


@dataclass(frozen=True)
class _InFlightSave:
    step: int
    path: Path
    done: Future  # resolves once the manifest is written
