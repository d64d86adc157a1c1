"""Checkpoints written before the format changed still verify and load: tests/assets/checkpoints holds one in
manifest format 1 (SHA-256 checksums, every tensor a torch.save record) written by paratrain before the change.
A resume from it through the CLI is in tests/integration/test_resume.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from paratrain.checkpoint import Checkpointer, verify_checkpoint
from paratrain.checkpoint.manifest import DamagedCheckpointError, read_manifest
from paratrain.checkpoint.state import ModelState
from paratrain.checkpoint.tensor_reader import TensorReader
from paratrain.errors import CheckpointError
from paratrain.models.gpt import build_gpt
from paratrain.parallel.collectives import quiet_single_process

OLD = Path(__file__).resolve().parents[1] / "assets" / "checkpoints" / "format-1-sha256" / "step-4"
MODEL_ARGS = {"block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 8}  # config.yaml beside it


def copy_of_old(tmp_path: Path) -> Path:
    return Path(shutil.copytree(OLD, tmp_path / "checkpoints" / "step-4"))


def test_the_old_checkpoint_is_format_1_and_still_verifies():
    manifest = verify_checkpoint(OLD)
    assert manifest["format"] == 1
    assert all(set(entry) == {"bytes", "sha256"} for entry in manifest["files"].values())


def test_a_damaged_old_checkpoint_is_refused_by_its_sha256(tmp_path):
    path = copy_of_old(tmp_path)
    shard = max(path.glob("*.distcp"), key=lambda file: file.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpointError, match=f"{shard} is corrupt: its sha256 checksum does not match"):
        verify_checkpoint(path)


def test_the_old_checkpoints_weights_load_as_torchs_own_reader_reads_them(tmp_path):
    path = copy_of_old(tmp_path)
    ours = build_gpt(**MODEL_ARGS)
    Checkpointer(tmp_path / "checkpoints", keep_last=None, rank=0, world_size=1, config={}).load(
        path, {"model": ModelState(ours)}
    )
    theirs = build_gpt(**MODEL_ARGS)
    with quiet_single_process():  # the asset is trusted: torch's reader unpickles freely
        dcp.load({"model": ModelState(theirs)}, checkpoint_id=path, no_dist=True)
    expected = theirs.state_dict()
    assert expected.keys() == ours.state_dict().keys()
    for name, value in ours.state_dict().items():
        assert torch.equal(value, expected[name]), name
    with TensorReader(path) as reader:  # an export's reader, every file it reads checked by its SHA-256
        exported = reader.read_all(f"model.{name}" for name in expected)
    assert all(torch.equal(exported[f"model.{name}"], value) for name, value in expected.items())


def test_a_manifest_from_a_newer_paratrain_is_refused_saying_to_upgrade(tmp_path):
    path = copy_of_old(tmp_path)
    manifest_path = path / "paratrain-manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "format": 99}))
    with pytest.raises(CheckpointError, match="manifest format 99.*upgrade paratrain"):
        read_manifest(path)
