"""Saves the storage refuses: the OSError found behind torch's wrappers, and the Checkpointer's stop."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from paratrain.checkpoint import Checkpointer
from paratrain.checkpoint.state import ModelState, Progress
from paratrain.checkpoint.storage_errors import find_storage_error
from paratrain.errors import CheckpointWriteError


def test_the_errno_is_found_behind_dcps_exception_and_torchs_enforce_fail():
    try:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None
    except RuntimeError as enforce_fail:
        wrapped = CheckpointException("write", {0: (enforce_fail, [])})
    assert find_storage_error(wrapped).errno == errno.ENOSPC
    assert find_storage_error(CheckpointException("write", {0: (ValueError("bad plan"), [])})) is None


def test_a_save_onto_a_read_only_filesystem_says_so_and_that_no_checkpoint_exists(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(directory)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        checkpointer = Checkpointer(directory, keep_last=None, rank=0, world_size=1, config={})
        with pytest.raises(CheckpointWriteError) as stopped:
            checkpointer.save(5, {"model": ModelState(torch.nn.Linear(2, 2)), "progress": Progress(5)})
    finally:
        subprocess.run(["umount", str(directory)], check=True)
    assert stopped.value.errno == errno.EROFS and stopped.value.checkpoint is None
    message = str(stopped.value)
    assert f"checkpoint step-5 was not saved: Read-only file system (EROFS) writing {directory / 'step-5'}" in message
    assert "no complete checkpoint exists yet" in message and "exit code 74" in message
