"""Nothing lost: a killed run resumes from its last complete checkpoint and ends bit-identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness import checkpoint_weights, read_metrics, tiny_config, train, write_config

STEPS = 60
EVERY = 30


def config_for(tmp_path: Path, name: str, strategy: str) -> Path:
    config = tiny_config(tmp_path / name, train={"max_steps": STEPS}, parallel={"strategy": strategy},
                         checkpoint={"every_steps": EVERY, "keep_last": 2}, log={"every_steps": 10})
    return write_config(tmp_path / f"{name}.yaml", config)


@pytest.mark.parametrize("strategy,nproc", [("single", 1), ("ddp", 2)])
def test_resume_after_sigkill_matches_uninterrupted_run_bit_for_bit(tmp_path, strategy, nproc):
    uninterrupted = config_for(tmp_path, "uninterrupted", strategy)
    interrupted = config_for(tmp_path, "interrupted", strategy)
    train(uninterrupted, nproc=nproc)

    # SIGKILL (no clean exit) on the last rank after step 35, i.e. 5 steps past the step-30 checkpoint.
    killed = train(interrupted, nproc=nproc, env={"PARATRAIN_FAULT": f"after_step:35:{nproc - 1}"}, check=False)
    assert killed.returncode != 0
    assert (tmp_path / "interrupted/checkpoints/step-30/paratrain-manifest.json").is_file()
    assert not (tmp_path / "interrupted/checkpoints/step-60").exists()

    resumed = train(interrupted, "checkpoint.resume=auto", nproc=nproc)
    assert "resumed from" in resumed.stderr and "step-30" in resumed.stderr

    final = f"checkpoints/step-{STEPS}"
    expected = checkpoint_weights(tmp_path / "uninterrupted" / final)
    actual = checkpoint_weights(tmp_path / "interrupted" / final)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), f"{name} differs after resume"
    # The steps it redid and the ones after logged the same losses as the uninterrupted run.
    uninterrupted_losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "uninterrupted")}
    resumed_losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "interrupted") if r["step"] > 30}
    assert resumed_losses == {step: uninterrupted_losses[step] for step in (40, 50, 60)}


def test_kill_during_checkpoint_save_leaves_previous_checkpoint_chosen_by_auto(tmp_path):
    config = write_config(tmp_path / "run.yaml", tiny_config(
        tmp_path / "run", train={"max_steps": 60}, checkpoint={"every_steps": 20}, log={"every_steps": 10}))

    killed = train(config, env={"PARATRAIN_FAULT": "mid_save:40"}, check=False)
    assert killed.returncode != 0
    half_written = tmp_path / "run/checkpoints/step-40"
    assert (half_written / ".metadata").is_file(), "DCP finished writing; only the completion marker is missing"
    assert not (half_written / "paratrain-manifest.json").exists()

    resumed = train(config)
    assert "resumed from" in resumed.stderr and "step-20 at step 20" in resumed.stderr
    assert (tmp_path / "run/checkpoints/step-60/paratrain-manifest.json").is_file()
