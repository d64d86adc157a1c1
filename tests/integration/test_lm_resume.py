"""Packed token data with loader workers: a run killed mid-epoch resumes bit-identical, and the token cache
built once is reused by every later run (and its ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paratrain.data.lm import packed_text
from paratrain.data.stdlib_corpus import train_tokenizer, write_stdlib_corpus
from tests.harness import checkpoint_weights, read_metrics, tiny_config, train, write_config

# The killed run saves every EVERY steps and dies after KILL_AFTER, mid-epoch, with its loader workers busy.
# Its step-COMPARE checkpoint is the uninterrupted state there; a run resumed from step-EVERY of the
# killed run's directory must reach it bit for bit (one launch less than training a separate reference).
STEPS, EVERY, COMPARE, KILL_AFTER = 16, 4, 12, 14


@pytest.fixture(scope="module")
def token_data(tmp_path_factory) -> dict:
    """The example's corpus and a small tokenizer trained on it, tokenized once here for every run."""
    root = tmp_path_factory.mktemp("stdlib")
    write_stdlib_corpus(root / "corpus.jsonl")
    train_tokenizer(root / "corpus.jsonl", root / "tokenizer.json", vocab_size=300)
    args = {"files": str(root / "corpus.jsonl"), "tokenizer": str(root), "cache_dir": str(root / "cache")}
    dataset = packed_text(**args, block_size=16)
    assert len(dataset) > 4 * STEPS * 8, "the kill lands mid-epoch"
    return {"factory": "paratrain.data.lm:packed_text", "args": {**args, "block_size": 16}, "num_workers": 2}


def config_for(directory: Path, token_data: dict, strategy: str) -> Path:
    config = tiny_config(
        directory / "run",
        train={"max_steps": STEPS},
        parallel={"strategy": strategy},
        checkpoint={"every_steps": EVERY, "keep_last": 4},
        log={"every_steps": 4},
        model={"args": {"vocab_size": 300, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 32}},
        data=token_data,
    )
    directory.mkdir(parents=True, exist_ok=True)
    return write_config(directory / "run.yaml", config)


def assert_resume_reproduces_the_killed_run(killed: Path, resumed: Path) -> None:
    compare = f"checkpoints/step-{COMPARE}"
    expected, actual = checkpoint_weights(killed / compare), checkpoint_weights(resumed / compare)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), f"{name} differs after resume"
    losses = {r["step"]: r["loss"] for r in read_metrics(killed)}
    resumed_losses = {r["step"]: r["loss"] for r in read_metrics(resumed)}
    assert resumed_losses[COMPARE] == losses[COMPARE]
    assert all(0 <= r["data_wait_fraction"] <= 1 for r in read_metrics(resumed))


def kill_mid_epoch(config: Path, output_dir: Path, *, nproc: int) -> None:
    killed = train(config, nproc=nproc, env={"PARATRAIN_FAULT": f"after_step:{KILL_AFTER}:{nproc - 1}"}, check=False)
    assert killed.returncode != 0, killed.stderr[-2000:]
    assert (output_dir / f"checkpoints/step-{COMPARE}/paratrain-manifest.json").is_file()
    assert not (output_dir / f"checkpoints/step-{STEPS}").exists()


def resume_overrides(killed: Path, resumed: Path) -> list[str]:
    return [f"checkpoint.resume={killed}/checkpoints/step-{EVERY}", f"run.output_dir={resumed}"]


def test_sigkill_mid_epoch_with_two_loader_workers_resumes_bit_identical_and_reuses_the_cache(tmp_path, token_data):
    config = config_for(tmp_path, token_data, "single")
    kill_mid_epoch(config, tmp_path / "run", nproc=1)
    # The resumed run is a process of its own, like the killed one. Trained inside the test process its weights
    # were not bit-identical (close, not equal); a fresh process is, so the in-process state is the difference.
    resumed = train(config, *resume_overrides(tmp_path / "run", tmp_path / "resumed"))
    assert "reusing the data cache" in resumed.stderr and "tokenizing" not in resumed.stderr
    assert f"step-{EVERY} at step {EVERY}" in resumed.stderr
    assert_resume_reproduces_the_killed_run(tmp_path / "run", tmp_path / "resumed")


def test_ddp_sigkill_mid_epoch_with_two_loader_workers_resumes_bit_identical(tmp_path, token_data):
    config = config_for(tmp_path, token_data, "ddp")
    kill_mid_epoch(config, tmp_path / "run", nproc=2)
    resumed = train(config, *resume_overrides(tmp_path / "run", tmp_path / "resumed"), nproc=2)
    assert f"step-{EVERY} at step {EVERY}" in resumed.stderr
    assert_resume_reproduces_the_killed_run(tmp_path / "run", tmp_path / "resumed")
