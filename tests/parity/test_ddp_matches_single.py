"""Parity: every layout, on the same seed and global batch, trains like a single process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import (
    checkpoint_weights,
    free_loopback_port,
    losses_by_step,
    max_relative_difference,
    max_weight_difference,
    read_metrics,
    start_cli,
    tiny_config,
    train,
    write_config,
)

STEPS = 50
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5


def run_layout(tmp_path: Path, name: str, *, nproc: int = 1, expect_layout: str | None = None, **sections) -> Path:
    output_dir = tmp_path / name
    config = tiny_config(output_dir, train={"max_steps": STEPS, **sections.pop("train", {})}, **sections)
    result = train(write_config(tmp_path / f"{name}.yaml", config), nproc=nproc)
    if expect_layout is not None:
        assert f"layout {expect_layout} on cpu" in result.stderr
    return output_dir


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> Path:
    # No parallel section, one process: a single process, no process group.
    return run_layout(tmp_path_factory.mktemp("single"), "single", expect_layout="single: one process")


def test_ddp_on_two_processes_matches_single_process_losses_and_weights(tmp_path, single_run):
    # The same config (no parallel section) started on two processes: adding processes is all DDP needs.
    ddp_run = run_layout(tmp_path, "ddp", nproc=2, expect_layout="ddp: dp_replicate=2")

    single_losses, ddp_losses = losses_by_step(single_run), losses_by_step(ddp_run)
    assert len(single_losses) == STEPS
    assert max_relative_difference(ddp_losses, single_losses) <= LOSS_RTOL
    final = f"checkpoints/step-{STEPS}"
    assert (
        max_weight_difference(checkpoint_weights(ddp_run / final), checkpoint_weights(single_run / final))
        <= WEIGHT_ATOL
    )
    assert single_losses[STEPS] < single_losses[1] - 0.5, "the reference run should actually learn"


def test_gradient_accumulation_of_four_micro_batches_matches_one_batch_of_four_times_the_size(tmp_path, single_run):
    # single_run: global batch 8 in micro-batches of 2 (4 accumulation steps); here: one batch of 8.
    whole = run_layout(tmp_path, "whole", parallel={"strategy": "single"}, train={"micro_batch_size": 8})

    assert max_relative_difference(losses_by_step(whole), losses_by_step(single_run)) <= LOSS_RTOL
    final = f"checkpoints/step-{STEPS}"
    assert (
        max_weight_difference(checkpoint_weights(whole / final), checkpoint_weights(single_run / final)) <= WEIGHT_ATOL
    )


def test_ddp_with_accumulation_on_two_processes_matches_single_process(tmp_path, single_run):
    # 2 ranks x micro-batch 1 x 4 accumulation steps: sync must happen only on the last micro-batch.
    ddp_run = run_layout(tmp_path, "ddp_accum", nproc=2, parallel={"strategy": "ddp"}, train={"micro_batch_size": 1})

    assert max_relative_difference(losses_by_step(ddp_run), losses_by_step(single_run)) <= LOSS_RTOL


def test_ddp_across_two_nodes_on_loopback_matches_single_process(tmp_path, single_run):
    output_dir = tmp_path / "two_nodes"
    config = write_config(
        tmp_path / "two_nodes.yaml", tiny_config(output_dir, train={"max_steps": STEPS}, parallel={"strategy": "ddp"})
    )
    endpoint = f"127.0.0.1:{free_loopback_port()}"
    nodes = [
        start_cli(
            [
                "train",
                str(config),
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(rank),
                "--rdzv-endpoint",
                endpoint,
            ]
        )
        for rank in (0, 1)
    ]
    for node in nodes:
        _, stderr = node.communicate(timeout=240)
        assert node.returncode == 0, stderr[-3000:]

    assert max_relative_difference(losses_by_step(output_dir), losses_by_step(single_run)) <= LOSS_RTOL
    assert read_metrics(output_dir)[-1]["world_size"] == 2
