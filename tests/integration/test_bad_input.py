"""Bad input fails before training: on stderr, naming the key and the fix, exit code 2, no torch
traceback, and nothing already in output_dir lost.

The table of bad inputs, every section and command, is test_bad_input_table.py; these are the cases that
need more than one command line (an earlier run, a corrupt checkpoint). One test runs the real command line
as a user would."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness import checkpoint_weights, run_cli, run_cli_in_process, tiny_config, train, write_config

SENTINEL = "earlier results\n"


@pytest.fixture
def output_dir(tmp_path) -> Path:
    """An output dir holding an earlier run's files, which a failed start must not touch."""
    directory = tmp_path / "run"
    directory.mkdir()
    (directory / "metrics.jsonl").write_text(SENTINEL)
    return directory


def fails_cleanly(args: list[str], *expected: str, output_dir: Path | None = None, own_process: bool = False) -> str:
    if own_process:
        result = run_cli(args)
        code, stderr = result.returncode, result.stderr
    else:
        code, stderr = run_cli_in_process(args)
    assert code == 2, f"exit {code}; stderr:\n{stderr}"
    assert "Traceback" not in stderr, stderr
    for text in expected:
        assert text in stderr, f"{text!r} not in:\n{stderr}"
    if output_dir is not None:
        assert (output_dir / "metrics.jsonl").read_text() == SENTINEL
        assert not (output_dir / "config.yaml").exists()
    return stderr


def config_file(tmp_path: Path, output_dir: Path, **sections) -> str:
    return str(write_config(tmp_path / "config.yaml", tiny_config(output_dir, **sections)))


def test_every_config_error_is_reported_at_once(tmp_path, output_dir):
    fails_cleanly(
        ["train", config_file(tmp_path, output_dir), "train.max_stepz=5", "optim.lr=-1", "precision=fp8"],
        "3 problems",
        "train.max_stepz",
        "optim.lr",
        "precision",
        output_dir=output_dir,
        own_process=True,
    )


def test_output_dir_that_is_not_writable_is_refused(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    fails_cleanly(["train", config_file(tmp_path, blocker / "run")], "run.output_dir", "is a file, not a directory")


def test_resume_never_refuses_to_mix_with_existing_checkpoints(tmp_path, output_dir):
    (output_dir / "checkpoints/step-10").mkdir(parents=True)
    fails_cleanly(
        ["train", config_file(tmp_path, output_dir), "checkpoint.resume=never"],
        "checkpoint.resume=never",
        "use checkpoint.resume=auto",
        output_dir=output_dir,
    )


def test_missing_config_file_is_named(tmp_path):
    fails_cleanly(["train", str(tmp_path / "nope.yaml")], "nope.yaml does not exist")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A short run with checkpoints at steps 2 and 4."""
    tmp_path = tmp_path_factory.mktemp("finished")
    config = tiny_config(tmp_path / "run", train={"max_steps": 4}, checkpoint={"every_steps": 2})
    train(write_config(tmp_path / "config.yaml", config))
    return tmp_path / "run"


def truncate_shard(checkpoint: Path) -> Path:
    shard = next(checkpoint.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])
    return shard


def test_truncated_checkpoint_given_as_resume_path_is_refused_naming_the_file(tmp_path, finished_run):
    run = tmp_path / "copy"
    copy_tree(finished_run, run)
    shard = truncate_shard(run / "checkpoints/step-4")
    fails_cleanly(
        ["train", config_file(tmp_path, tmp_path / "new"), f"checkpoint.resume={run}/checkpoints/step-4"],
        "checkpoint.resume=",
        str(shard),
        "truncated",
    )


def test_a_resume_path_with_a_flipped_byte_stops_the_run_naming_the_file_with_nothing_written(
    tmp_path, finished_run, output_dir
):
    run = tmp_path / "copy"
    copy_tree(finished_run, run)
    shard = flip_a_byte(sorted((run / "checkpoints/step-4").glob("*.distcp"))[-1])
    # Its size is right, so only the load, which hashes each file as it reads it, finds the damage.
    fails_cleanly(
        [
            "train",
            config_file(tmp_path, output_dir, train={"max_steps": 4}),
            f"checkpoint.resume={run}/checkpoints/step-4",
        ],
        "checkpoint.resume=",
        f"checkpoint file {shard} is corrupt",
        "use an earlier checkpoint",
        output_dir=output_dir,
    )


def flip_a_byte(shard: Path) -> Path:
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, different checksum
    shard.write_bytes(bytes(data))
    return shard


def test_corrupt_latest_checkpoint_makes_auto_fall_back_to_the_previous_one(tmp_path, finished_run):
    run = tmp_path / "copy"
    copy_tree(finished_run, run)
    shard = flip_a_byte(sorted((run / "checkpoints/step-4").glob("*.distcp"))[-1])  # read last: the others load first

    result = train(Path(config_file(tmp_path, run, train={"max_steps": 4})))  # the finished run's config
    assert str(shard) in result.stderr and "corrupt" in result.stderr
    assert "resumed from" in result.stderr and "step-2 at step 2" in result.stderr
    # The resume read step-4's healthy files into the model before it met the damaged one; the fallback's
    # load overwrote all of it: steps 3 and 4 trained again end where the uninterrupted run ended.
    expected = checkpoint_weights(finished_run / "checkpoints/step-4")
    actual = checkpoint_weights(run / "checkpoints/step-4")
    assert expected.keys() == actual.keys()
    assert all(torch.equal(actual[name], expected[name]) for name in expected)


def test_planted_pickle_in_checkpoint_metadata_is_refused(tmp_path, finished_run):
    run = tmp_path / "copy"
    copy_tree(finished_run, run)
    checkpoint = run / "checkpoints/step-4"
    plant_pickle_payload(checkpoint / ".metadata", marker=tmp_path / "pwned")

    fails_cleanly(
        ["train", config_file(tmp_path, tmp_path / "new"), f"checkpoint.resume={checkpoint}"],
        "refusing to load",
        "posix.system",
    )
    assert not (tmp_path / "pwned").exists()


def plant_pickle_payload(metadata: Path, *, marker: Path) -> None:
    """Replaces DCP's metadata with a pickle that runs a shell command, and fixes up the manifest
    so the checksums agree: an attacker who can write the directory can write both."""
    import hashlib
    import json
    import os
    import pickle

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    metadata.write_bytes(pickle.dumps(Payload()))
    manifest_path = metadata.parent / "paratrain-manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][metadata.name] = {
        "bytes": metadata.stat().st_size,
        "sha256": hashlib.sha256(metadata.read_bytes()).hexdigest(),
    }
    manifest_path.write_text(json.dumps(manifest))


def copy_tree(source: Path, destination: Path) -> None:
    import shutil

    shutil.copytree(source, destination)


def test_options_without_effect_in_the_layout_are_warned_about_and_training_goes_on(tmp_path):
    config = config_file(tmp_path, tmp_path / "run", train={"max_steps": 2})
    result = train(Path(config), "parallel.fsdp.reshard_after_forward=false", "parallel.sequence_parallel=true")
    assert "parallel.fsdp.reshard_after_forward has no effect with the single: one process layout" in result.stderr
    assert "parallel.sequence_parallel has no effect without tensor parallel" in result.stderr


def test_fsdp_on_a_model_without_blocks_shards_it_as_one_unit_and_says_so(tmp_path):
    config = config_file(
        tmp_path,
        tmp_path / "run",
        train={"max_steps": 2},
        model={"factory": "tests.integration.plain_models:build_sequential", "args": {}},
        data={"factory": "paratrain.data.regression:build_regression_dataset", "args": {"in_features": 4}},
        loss={"factory": "paratrain.losses:mse"},
    )
    result = train(Path(config), "parallel.strategy=fsdp", nproc=2)
    assert "the model declares no blocks" in result.stderr and "sharding it as one unit" in result.stderr
