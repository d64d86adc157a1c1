"""Pipeline layouts train like a single process (losses and final weights within 1e-5), their
checkpoints move to and from layouts without a pipeline, and the timeline each rank records is the
order the schedule table says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from paratrain.parallel.pipeline.schedules import PipelineShape, action_table
from paratrain.parallel.pipeline.timeline import LETTER
from tests.harness import LayoutRuns, checkpoint_weights, losses_by_step, max_relative_difference, run_cli

STEPS = 20
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5

LAYOUTS = {
    "single": ([], 1),
    "pp 2 stages": (["parallel.strategy=pp"], 2),
    "pp 4 stages": (["parallel.strategy=pp"], 4),
    "interleaved 2 ranks x 2 stages": (["parallel.strategy=pp", "pipeline.schedule=Interleaved1F1B"], 2),
    "zero bubble V 2 ranks x 2 stages": (["parallel.strategy=pp", "pipeline.schedule=ZBVZeroBubble"], 2),
    "ddp 2 x pp 2": (["parallel.strategy=ddp", "parallel.pp=2"], 4),
    "fsdp 2 x pp 2": (["parallel.pp=2", "parallel.dp_shard=2"], 4),  # degrees alone, no strategy named
    "tp 2 x pp 2": (["parallel.strategy=tp", "parallel.pp=2"], 4),
    "model_parallel 3 parts": (["parallel.strategy=model_parallel", "pipeline.devices=[cpu,cpu,cpu]"], 1),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> LayoutRuns:
    together = tuple(name for name, (_, nproc) in LAYOUTS.items() if nproc > 1)
    return LayoutRuns(
        tmp_path_factory.mktemp("pipeline"),
        LAYOUTS,
        together=together,
        train={"max_steps": STEPS},
        checkpoint={"every_steps": 10, "keep_last": None},
    )


def assert_weights_close(actual_checkpoint: Path, expected_checkpoint: Path) -> None:
    expected, actual = checkpoint_weights(expected_checkpoint), checkpoint_weights(actual_checkpoint)
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=WEIGHT_ATOL, msg=name)


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "single"])
def test_pipeline_layout_matches_single_process(runs, layout):
    reference, piped = runs.get("single"), runs.get(layout)
    assert max_relative_difference(losses_by_step(piped), losses_by_step(reference)) <= LOSS_RTOL
    assert_weights_close(piped / f"checkpoints/step-{STEPS}", reference / f"checkpoints/step-{STEPS}")


@pytest.mark.parametrize("source,target", [("pp 2 stages", "single"), ("single", "interleaved 2 ranks x 2 stages")])
def test_checkpoint_moves_between_pipeline_and_other_layouts(runs, source, target):
    """Resuming step 10 of one layout under the other ends where the single process ends."""
    checkpoint = runs.get(source) / "checkpoints/step-10"
    resumed = runs.get(target, f"checkpoint.resume={checkpoint}", name=f"{source} to {target}")
    reference = runs.get("single")
    assert min(losses_by_step(resumed)) == 11  # continued, did not start over
    assert (
        max_relative_difference(
            losses_by_step(resumed), {step: loss for step, loss in losses_by_step(reference).items() if step > 10}
        )
        <= LOSS_RTOL
    )
    assert_weights_close(resumed / f"checkpoints/step-{STEPS}", reference / f"checkpoints/step-{STEPS}")


def test_export_consolidates_a_pipeline_checkpoint(runs, tmp_path):
    checkpoint = runs.get("ddp 2 x pp 2") / f"checkpoints/step-{STEPS}"
    out = tmp_path / "model.safetensors"
    result = run_cli(["export", str(checkpoint), "--out", str(out)])
    assert result.returncode == 0, result.stderr
    exported = load_file(str(out))
    expected = checkpoint_weights(runs.get("single") / f"checkpoints/step-{STEPS}")
    assert exported.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(exported[name], expected[name], rtol=0, atol=WEIGHT_ATOL, msg=name)


@pytest.mark.parametrize(
    "layout", ["pp 2 stages", "interleaved 2 ranks x 2 stages", "zero bubble V 2 ranks x 2 stages"]
)
def test_recorded_timeline_runs_the_schedule_table_order(runs, layout):
    """What ``paratrain pipeline show`` draws in theory is the order each rank really ran."""
    records = [
        json.loads(path.read_text()) for path in sorted((runs.get(layout) / "pipeline").glob("timeline-rank*.json"))
    ]
    assert records, "the run wrote no pipeline timeline"
    assert sorted(record["pp_rank"] for record in records) == list(range(records[0]["pp"]))  # every stage rank
    for record in records:
        assert record["steps"], f"rank {record['pp_rank']} recorded no step"
        shape = PipelineShape(record["schedule"], record["pp"], record["stages_per_rank"], record["microbatches"])
        expected = [
            (a.stage_index, LETTER[a.computation_type], a.microbatch_index)
            for a in action_table(shape)[record["pp_rank"]]
        ]
        for step in record["steps"]:
            assert [(stage, kind, mb) for stage, kind, mb, _, _ in step["actions"]] == expected


def test_pipeline_show_prints_each_rank_and_both_bubbles_and_draws_them(runs, tmp_path):
    run_dir = runs.get("pp 2 stages")
    out = tmp_path / "schedule.png"
    result = run_cli(
        [
            "pipeline",
            "show",
            str(run_dir / "config.yaml"),
            "--nproc-per-node",
            "2",
            "--out",
            str(out),
            "--run",
            str(run_dir),
        ]
    )
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "rank 0: 0F0  0F1" in text and "rank 1:   .  1F0  1B0" in text
    assert "bubble in theory" in text and "1/5 = 0.200" in text  # p=2, m=4: (p-1)/(m+p-1)
    measured = _measured(text)
    assert 0.0 < measured < 1.0
    for png in (out, tmp_path / "schedule-measured.png"):
        image = plt_imread(png)
        assert image.shape[0] > 100 and image.shape[1] > 400


def _measured(text: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith("bubble measured"))
    return float(line.rsplit(": ", 1)[1])


def plt_imread(path: Path):
    import matplotlib.image

    return matplotlib.image.imread(str(path))
