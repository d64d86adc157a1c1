from __future__ import annotations

import pytest
import torch

from paratrain.checkpoint import Checkpointer, find_checkpoints, verify_checkpoint
from paratrain.checkpoint.state import ModelState, Progress
from paratrain.errors import CheckpointError


def make_checkpointer(tmp_path, keep_last=2) -> Checkpointer:
    return Checkpointer(tmp_path / "checkpoints", keep_last=keep_last, rank=0, world_size=1, config={"seed": 0})


def state(step: int) -> dict:
    torch.manual_seed(step)
    return {"model": ModelState(torch.nn.Linear(4, 2)), "progress": Progress(step)}


def steps_on_disk(checkpointer: Checkpointer) -> list[int]:
    return [step for step, _ in find_checkpoints(checkpointer.directory)]


def test_rotation_keeps_the_newest_complete_checkpoints(tmp_path):
    checkpointer = make_checkpointer(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40):
        checkpointer.save(step, state(step))
    assert steps_on_disk(checkpointer) == [30, 40]


def test_rotation_removes_stale_incomplete_saves_but_counts_only_complete_ones(tmp_path):
    checkpointer = make_checkpointer(tmp_path, keep_last=1)
    checkpointer.save(10, state(10))
    (checkpointer.directory / "step-15").mkdir()  # a crashed save: no manifest
    (checkpointer.directory / "step-25").mkdir()  # newer than what completes next: left alone
    checkpointer.save(20, state(20))
    assert steps_on_disk(checkpointer) == [20, 25]
    assert checkpointer.latest_verified() == checkpointer.directory / "step-20"


def test_load_restores_saved_values(tmp_path):
    checkpointer = make_checkpointer(tmp_path)
    saved = state(7)
    checkpointer.save(7, saved)
    restored = state(99)
    checkpointer.load(checkpointer.directory / "step-7", restored)
    assert restored["progress"].step == 7
    assert torch.equal(restored["model"].model.weight, saved["model"].model.weight)


def test_auto_resume_skips_a_damaged_latest_checkpoint(tmp_path, caplog):
    checkpointer = make_checkpointer(tmp_path, keep_last=3)
    checkpointer.save(1, state(1))
    checkpointer.save(2, state(2))
    (checkpointer.directory / "step-2" / ".metadata").write_bytes(b"garbage")
    assert checkpointer.choose_resume("auto") == checkpointer.directory / "step-1"
    assert "step-2/.metadata" in caplog.text


def test_auto_resume_skips_a_latest_checkpoint_with_a_truncated_shard_naming_it(tmp_path, caplog):
    checkpointer = make_checkpointer(tmp_path, keep_last=3)
    checkpointer.save(1, state(1))
    checkpointer.save(2, state(2))
    shard = next((checkpointer.directory / "step-2").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    assert checkpointer.choose_resume("auto") == checkpointer.directory / "step-1"
    assert f"checkpoint file {shard} is truncated" in caplog.text and "falling back" in caplog.text


def test_auto_resume_refuses_when_no_checkpoint_verifies(tmp_path):
    checkpointer = make_checkpointer(tmp_path)
    checkpointer.save(1, state(1))
    shard = next((checkpointer.directory / "step-1").glob("*.distcp"))
    shard.write_bytes(b"")
    with pytest.raises(CheckpointError, match="no checkpoint .* verifies"):
        checkpointer.choose_resume("auto")


def test_verify_names_a_missing_file(tmp_path):
    checkpointer = make_checkpointer(tmp_path)
    path = checkpointer.save(1, state(1))
    shard = next(path.glob("*.distcp"))
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard} is missing"):
        verify_checkpoint(path)


def test_fresh_directory_has_nothing_to_resume(tmp_path):
    assert make_checkpointer(tmp_path).choose_resume("auto") is None
