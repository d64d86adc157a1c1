"""Parity with uneven loss masks: the loss is the mean over the global batch's target tokens, so gradient
accumulation and the data-parallel size give the same losses and weights when micro-batches hold
different numbers of targets (a mean of per-micro-batch means would not)."""

from __future__ import annotations

import pytest

from tests.harness import (
    LayoutRuns,
    checkpoint_weights,
    losses_by_step,
    max_relative_difference,
    max_weight_difference,
)

STEPS = 20
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5
MASKED = {"factory": "tests.masked_data:build_unevenly_masked_chars", "args": {"block_size": 16}}
LAYOUTS = {
    # global batch 8: micro-batches of 2 (4 accumulation steps) on one process...
    "single": (["parallel.strategy=single"], 1),
    # ...one micro-batch of 8...
    "whole": (["parallel.strategy=single", "train.micro_batch_size=8"], 1),
    # ...2 ranks x 1 x 4 accumulation steps, fsdp over 2 ranks x 2 x 2...
    "ddp_accum": (["parallel.strategy=ddp", "train.micro_batch_size=1"], 2),
    "fsdp": (["parallel.strategy=fsdp"], 2),
    # ...and pipelines of 2 stages whose schedules run the 4 micro-batches.
    "pp": (["parallel.strategy=pp"], 2),
    "pp zero bubble V": (["parallel.strategy=pp", "pipeline.schedule=ZBVZeroBubble"], 2),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> LayoutRuns:
    return LayoutRuns(
        tmp_path_factory.mktemp("masked"),
        LAYOUTS,
        together=tuple(LAYOUTS),
        train={"max_steps": STEPS, "deterministic": True},
        checkpoint={"every_steps": STEPS},
        data=MASKED,
    )


@pytest.mark.parametrize("layout", ["whole", "ddp_accum", "fsdp", "pp", "pp zero bubble V"])
def test_unevenly_masked_targets_train_alike_under_every_layout(runs, layout):
    reference, other = runs.get("single"), runs.get(layout)
    assert len(losses_by_step(reference)) == STEPS
    assert max_relative_difference(losses_by_step(other), losses_by_step(reference)) <= LOSS_RTOL
    final = f"checkpoints/step-{STEPS}"
    assert (
        max_weight_difference(checkpoint_weights(other / final), checkpoint_weights(reference / final)) <= WEIGHT_ATOL
    )
