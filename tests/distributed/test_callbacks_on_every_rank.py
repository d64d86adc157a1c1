"""Callbacks, evaluation, the profiler and early stopping on 2 ranks, under ddp and fsdp: one torchrun
launch (check_callbacks_eval_profile.py) trains both layouts; the tests read what each rank wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import launch_workers, read_metrics

WORKER = "tests.distributed.check_callbacks_eval_profile"
LAYOUTS = ("ddp", "fsdp")
RANKS = (0, 1)

# eval every 2 steps, log every 4 (and eval steps), checkpoint every 4; early stopping ends the run at 6.
EXPECTED_EVENTS = [
    ["train_start", 0, None],
    ["step_end", 1, "logged"],
    ["evaluation", 2, None],
    ["step_end", 2, "logged"],
    ["step_end", 3, None],
    ["evaluation", 4, None],
    ["step_end", 4, "logged"],
    ["checkpoint_saved", 4, "step-4"],
    ["step_end", 5, None],
    ["evaluation", 6, None],
    ["step_end", 6, "logged"],
    ["checkpoint_saved", 6, "step-6"],
    ["train_end", 6, None],
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("callbacks")
    result = launch_workers(2, WORKER, str(root / "results.json"), str(root), *LAYOUTS)
    assert result.returncode == 0, result.stderr[-4000:]
    return root


def recorded(runs: Path, layout: str, rank: int) -> dict:
    return json.loads((runs / layout / f"events-rank{rank}.json").read_text())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_callbacks_fire_in_order_on_every_rank_and_only_at_their_steps(runs, layout):
    for rank in RANKS:
        assert recorded(runs, layout, rank)["events"] == EXPECTED_EVENTS, f"rank {rank}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_early_stopping_stops_every_rank_at_the_step_one_rank_decided(runs, layout):
    # Rank 0's probe improves at every step: alone it would train to step 8. Rank 1's stops improving
    # after step 2; with patience 2 (log steps 4 and 6) every rank stops after step 6.
    assert json.loads((runs / "results.json").read_text())[layout] == {"steps": 6}
    assert [record["step"] for record in read_metrics(runs / layout)] == [1, 2, 4, 6]
    assert sorted(path.name for path in (runs / layout / "checkpoints").glob("step-*")) == ["step-4", "step-6"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_eval_loss_averaged_across_ranks_equals_the_loss_computed_by_hand(runs, layout):
    # 33 validation samples: the ranks hold 17 and 16 of them, so a plain mean of the ranks' means
    # would differ from the loss over all samples at once.
    logged = {record["step"]: record["eval_loss"] for record in read_metrics(runs / layout) if "eval_loss" in record}
    for rank in RANKS:
        evaluations = recorded(runs, layout, rank)["evaluations"]
        assert [e["step"] for e in evaluations] == [2, 4, 6]
        for e in evaluations:
            assert e["eval_loss"] == pytest.approx(e["by_hand"], rel=1e-6), e
            assert logged[e["step"]] == e["eval_loss"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_profiler_writes_a_trace_per_rank_that_parses(runs, layout):
    for rank in RANKS:
        trace = json.loads((runs / layout / "profile" / f"trace-rank{rank}.json").read_text())
        steps = {event["name"] for event in trace["traceEvents"] if event.get("name", "").startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#2", "ProfilerStep#3"}  # wait 1, warmup 1, active 2


def test_memory_is_reduced_to_min_and_max_over_ranks_and_throughput_is_logged(runs):
    for record in read_metrics(runs / "ddp"):
        for name in ("mem_rss_mb", "mem_peak_rss_mb"):
            assert 0 < record[f"{name}_min"] <= record[f"{name}_max"]
        assert record["flops_per_s"] == pytest.approx(2 * record["flops_per_s_per_device"])
        assert "mfu" not in record  # no peak FLOP/s is known for a CPU
