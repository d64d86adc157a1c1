"""A load checks each checkpoint file against its manifest as it reads it (one pass over the bytes): a
damaged file never reaches the state, a resume falls back past it, and a clean load is exact."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful

from paratrain.checkpoint import Checkpointer
from paratrain.checkpoint.manifest import DamagedCheckpointError
from paratrain.checkpoint.policy import choose_resume, load_resume
from paratrain.checkpoint.safe_reader import SafeFileSystemReader
from paratrain.checkpoint.state import ModelState, Progress
from paratrain.config.schema import CheckpointConfig
from paratrain.errors import CheckpointError

CONFIG = {"seed": 0}


def make_checkpointer(tmp_path: Path) -> Checkpointer:
    return Checkpointer(tmp_path / "checkpoints", keep_last=None, rank=0, world_size=1, config=CONFIG)


def state(step: int) -> dict:
    torch.manual_seed(step)
    return {"model": ModelState(torch.nn.Linear(64, 32)), "progress": Progress(step)}


def flip_a_byte(path: Path) -> Path:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different checksum
    path.write_bytes(bytes(data))
    return path


def truncate(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[:-10])
    return path


def shards(checkpoint: Path) -> list[Path]:
    return sorted(checkpoint.glob("*.distcp"))


def resume(checkpointer: Checkpointer, into: dict, *, resume: str = "auto") -> Path:
    """What a run's start does: choose (cheap checks), then load (every file checked as it is read)."""
    options = CheckpointConfig(resume=resume)
    chosen = choose_resume(checkpointer, options, config=CONFIG, is_main=True)
    return load_resume(checkpointer, chosen, into, options=options, config=CONFIG, is_main=True, optional=())


def weights(into: dict) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in into["model"].model.state_dict().items()}


@pytest.mark.parametrize("damage", [flip_a_byte, truncate])
def test_a_load_refuses_damaged_files_before_copying_anything_from_them(tmp_path, damage):
    checkpointer = make_checkpointer(tmp_path)
    path = checkpointer.save(1, state(1))
    for shard in shards(path):  # every file damaged: nothing at all may reach the state
        damage(shard)
    into = state(99)
    before = weights(into)
    expected = "is corrupt" if damage is flip_a_byte else "is truncated"
    with pytest.raises(DamagedCheckpointError, match=f"{shards(path)[0]} {expected}.*use an earlier checkpoint"):
        checkpointer.load(path, into)
    for name, value in weights(into).items():
        assert torch.equal(value, before[name]), f"{name} was overwritten from a damaged file"
    assert into["progress"].step == 99


def test_a_clean_resume_loads_the_newest_checkpoint_exactly(tmp_path):
    checkpointer = make_checkpointer(tmp_path)
    for step in (1, 2):
        checkpointer.save(step, state(step))
    into = state(99)
    assert resume(checkpointer, into) == checkpointer.directory / "step-2"
    assert into["progress"].step == 2
    for name, value in weights(state(2)).items():
        assert torch.equal(weights(into)[name], value)


def test_auto_resume_falls_back_past_a_shard_with_a_flipped_byte_found_while_loading(tmp_path, caplog):
    checkpointer = make_checkpointer(tmp_path)
    for step in (1, 2):
        checkpointer.save(step, state(step))
    shard = flip_a_byte(shards(checkpointer.directory / "step-2")[-1])
    # The choice reads no data, so it takes step-2; the load finds the damage, and every entry of the
    # state ends as step-1 left it, including what step-2's healthy file had already copied in.
    into = state(99)
    assert resume(checkpointer, into) == checkpointer.directory / "step-1"
    assert into["progress"].step == 1
    for name, value in weights(state(1)).items():
        assert torch.equal(weights(into)[name], value), f"{name} is not step-1's"
    assert f"checkpoint file {shard} is corrupt" in caplog.text and "falling back" in caplog.text


def test_auto_resume_refuses_when_the_only_checkpoint_proves_damaged_while_loading(tmp_path):
    checkpointer = make_checkpointer(tmp_path)
    checkpointer.save(1, state(1))
    flip_a_byte(shards(checkpointer.directory / "step-1")[0])
    with pytest.raises(CheckpointError, match="no checkpoint .* verifies"):
        resume(checkpointer, state(99))


def test_a_damaged_resume_path_is_an_error_naming_the_file_and_the_fix(tmp_path):
    checkpointer = make_checkpointer(tmp_path)
    for step in (1, 2):
        checkpointer.save(step, state(step))
    path = checkpointer.directory / "step-2"
    shard = flip_a_byte(shards(path)[0])
    with pytest.raises(CheckpointError, match=f"checkpoint.resume={path}: checkpoint file {shard} is corrupt.*earlier"):
        resume(checkpointer, state(99), resume=str(path))


def test_a_damaged_file_the_load_does_not_read_still_fails_the_load_naming_it(tmp_path):
    checkpointer = make_checkpointer(tmp_path)
    path = checkpointer.save(1, state(1))
    storage = SafeFileSystemReader(path).read_metadata().storage_data
    holding_progress = {info.relative_path for index, info in storage.items() if index.fqn.startswith("progress.")}
    unread = [shard for shard in shards(path) if shard.name not in holding_progress]
    assert unread, "the test needs a file that loading the progress alone does not read"
    flip_a_byte(unread[0])
    with pytest.raises(DamagedCheckpointError, match=f"{unread[0]} is corrupt"):
        checkpointer.load(path, {"progress": Progress()})


def test_equal_saved_values_load_as_separate_objects(tmp_path):
    checkpointer = make_checkpointer(tmp_path)
    path = checkpointer.save(1, {"lists": Lists({"a": [1, 2], "b": [1, 2]})})  # equal bytes, loaded once
    into = Lists({"a": [], "b": []})
    checkpointer.load(path, {"lists": into})
    assert into.values == {"a": [1, 2], "b": [1, 2]}
    into.values["a"].append(3)
    assert into.values["b"] == [1, 2], "two entries share one loaded object"


@dataclass
class Lists(Stateful):
    values: dict

    def state_dict(self) -> dict:
        return dict(self.values)

    def load_state_dict(self, state_dict: dict) -> None:
        self.values = dict(state_dict)
