"""The non-finite guard: a NaN injected into the gradients at step 5 (fault point ``nan_grad``) under
every kind of layout. With ``train.nonfinite=stop`` the run ends with exit code 3 before that step is
applied or saved, every checkpoint on disk is finite, and ``resume: auto`` continues from the last
healthy one to the end. With ``skip`` the run finishes, the skipped step is logged, and metrics.jsonl
stays strict JSON. The stop runs use fused optimizers (the default, ``optim.fused=auto``), which skip the step on
the device and have the loop read the verdict one step late; the skip runs use foreach (``optim.fused=off``),
read on the host.
The multi-process layouts train in one two-process launch."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from paratrain.errors import EXIT_NONFINITE
from tests.harness import checkpoint_weights, launch_workers, read_metrics, tiny_config, write_config

STEPS, NAN_STEP, EVERY = 6, 5, 3
LAYOUTS = {
    "single": ([], 1),
    "ddp x2": (["parallel.strategy=ddp"], 2),
    "fsdp x2": (["parallel.strategy=fsdp"], 2),
    "pp x2": (["parallel.strategy=pp"], 2),
}

# The pp run's checkpoint is resumed by ddp x2, which reads it whole (a pipeline checkpoint resumed under a
# pipeline layout once lost its optimizer groups' lr: checkpoint/state.py).
RESUME_LAYOUT = {"pp x2": ["parallel.strategy=ddp"]}


def _runs(root: Path, layout: str) -> list[list]:
    """stop (faulted), its resume (no fault, same output dir), skip (faulted): [name, config, overrides, fault]."""
    overrides = LAYOUTS[layout][0]
    slug = layout.replace(" ", "_")
    fault = f"nan_grad:{NAN_STEP}"
    stopped = write_config(root / f"{slug}-stop.yaml", tiny_config(root / f"{slug}-stop"))
    skipped = write_config(root / f"{slug}-skip.yaml", tiny_config(root / f"{slug}-skip", optim={"fused": "off"}))
    return [
        [f"{layout} stop", str(stopped), [*overrides, "train.nonfinite=stop"], fault],
        [f"{layout} resume", str(stopped), RESUME_LAYOUT.get(layout, overrides), None],
        [f"{layout} skip", str(skipped), [*overrides, "train.nonfinite=skip"], fault],
    ]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> tuple[Path, dict[str, int]]:
    """Every layout's three runs: single in this process, the others in one two-process launch."""
    root = tmp_path_factory.mktemp("nonfinite")
    shared = [f"train.max_steps={STEPS}", f"checkpoint.every_steps={EVERY}", "checkpoint.resume=auto"]
    codes: dict[str, int] = {}
    runs = {layout: [[n, c, [*o, *shared], f] for n, c, o, f in _runs(root, layout)] for layout in LAYOUTS}
    late = write_config(root / "late.yaml", tiny_config(root / "late", log={"every_steps": 100}))
    runs["single"].append(["late verdict", str(late), [*shared, "train.nonfinite=stop"], f"nan_grad:{NAN_STEP}"])
    codes.update(_train_in_this_process(runs["single"]))
    together = [run for layout in LAYOUTS if LAYOUTS[layout][1] == 2 for run in runs[layout]]
    runs_file, codes_file = root / "runs.json", root / "codes.json"
    runs_file.write_text(json.dumps(together))
    result = launch_workers(2, "tests.integration.nonfinite_runs", str(runs_file), str(codes_file), timeout=600)
    assert codes_file.exists(), f"launch failed ({result.returncode}):\n{result.stderr[-4000:]}"
    codes.update(json.loads(codes_file.read_text()))
    return root, codes


def _train_in_this_process(runs: list[list]) -> dict[str, int]:
    import os

    from paratrain.launch.faults import ENV_VAR
    from paratrain.train import main as train_main

    codes = {}
    for name, config_path, overrides, fault in runs:
        os.environ.pop(ENV_VAR, None)
        if fault:
            os.environ[ENV_VAR] = fault
        try:
            codes[name] = train_main([config_path, *overrides])
        finally:
            os.environ.pop(ENV_VAR, None)
    return codes


def _steps_logged(output_dir: Path) -> list[int]:
    return [record["step"] for record in read_metrics(output_dir)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stop_ends_before_the_nan_step_and_leaves_only_finite_checkpoints(outcomes, layout):
    root, codes = outcomes
    assert codes[f"{layout} stop"] == EXIT_NONFINITE
    output_dir = root / f"{layout.replace(' ', '_')}-stop"
    first_attempt = _steps_logged(output_dir)[: NAN_STEP - 1]
    assert first_attempt == list(range(1, NAN_STEP)), "the NaN step itself must not be logged as trained"
    for checkpoint in sorted((output_dir / "checkpoints").iterdir()):
        manifest = json.loads((checkpoint / "paratrain-manifest.json").read_text())
        assert manifest["weights_finite"] is True
        for name, tensor in checkpoint_weights(checkpoint).items():
            assert torch.isfinite(tensor).all(), f"{checkpoint}: {name} is not finite"


def test_a_verdict_read_one_step_late_still_stops_before_any_save_after_the_nan_step(outcomes):
    """Logged only at step 1, the NaN step's verdict is read while step NAN_STEP + 1 runs: the run stops
    naming the NaN step, with only the checkpoint before it on disk."""
    root, codes = outcomes
    assert codes["late verdict"] == EXIT_NONFINITE
    assert _steps_logged(root / "late") == [1]
    assert sorted(path.name for path in (root / "late/checkpoints").iterdir()) == ["step-3"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_auto_continues_from_the_last_healthy_checkpoint(outcomes, layout):
    root, codes = outcomes
    assert codes[f"{layout} resume"] == 0
    output_dir = root / f"{layout.replace(' ', '_')}-stop"
    steps = _steps_logged(output_dir)
    last_healthy = (NAN_STEP - 1) // EVERY * EVERY  # the newest checkpoint before the NaN step
    assert steps == [*range(1, NAN_STEP), *range(last_healthy + 1, STEPS + 1)]
    assert all(math.isfinite(record["loss"]) for record in read_metrics(output_dir))
    final = checkpoint_weights(output_dir / f"checkpoints/step-{STEPS}")
    assert all(torch.isfinite(tensor).all() for tensor in final.values())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_skip_drops_the_nan_step_logs_it_and_finishes(outcomes, layout):
    root, codes = outcomes
    assert codes[f"{layout} skip"] == 0
    output_dir = root / f"{layout.replace(' ', '_')}-skip"
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # strict JSON: json.loads accepts NaN, so check below
    assert all("NaN" not in line and "Infinity" not in line for line in lines)
    assert [record["step"] for record in records] == list(range(1, STEPS + 1))
    nan_record = records[NAN_STEP - 1]
    assert nan_record["loss"] is None and nan_record["grad_norm"] is None
    assert set(nan_record["nonfinite"]) == {"loss", "grad_norm"}
    assert records[-1]["skipped_steps"] == 1 and math.isfinite(records[-1]["loss"])
    final = checkpoint_weights(output_dir / f"checkpoints/step-{STEPS}")
    assert all(torch.isfinite(tensor).all() for tensor in final.values())
