"""benchmarks/vs_torchtitan.py runs only on a GPU with torchtitan; what CI can check of it: paratrain's two
commands are valid configs of the shape claimed, torchtitan's step lines parse, and one FLOPs formula
reproduces the TFLOP/s torchtitan itself printed (so the MFU columns of both compare like with like)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from paratrain.config.loading import load_config
from tests.tools.benchmark_scripts import load_benchmark

# Two lines as torchtitan 0.2.2 printed them on an H200 (2026-11-26), colours included.
TITAN_LINES = (
    "[titan] 2026-11-26 01:52:52,125 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss: 12.29598  "
    "\x1b[38;2;180;60;0mgrad_norm:  3.3151  \x1b[38;2;54;234;195mmemory: 35.59GiB(25.46%)  "
    "\x1b[34mtps: 1,636  \x1b[36mtflops: 13.45  \x1b[35mmfu: 1.36%\x1b[39m\n"
    "[titan] 2026-11-26 01:52:58,047 - root - INFO - \x1b[31mstep: 21  \x1b[32mloss:  5.78514  "
    "\x1b[38;2;180;60;0mgrad_norm:  2.3687  \x1b[38;2;54;234;195mmemory: 50.71GiB(36.27%)  "
    "\x1b[34mtps: 57,722  \x1b[36mtflops: 474.48  \x1b[35mmfu: 47.98%\x1b[39m\n"
)
# torchtitan 0.2.2's start-up lines (train.py), as its logger writes them; "Building logger" must not count.
TITAN_START = (
    "[titan] 2026-11-26 01:52:40,000 - root - INFO - Starting job: Llama 3 debug training",
    "[titan] 2026-11-26 01:52:41,000 - root - INFO - Building logger with config: wandb=False, tensorboard=False",
    "[titan] 2026-11-26 01:52:44,000 - root - INFO - Building llama3 1B_matched with {",
    "[titan] 2026-11-26 01:52:50,000 - root - INFO - Trainer is initialized with local batch size 8, global batch size 8",
)


@pytest.fixture(scope="module")
def script():
    return load_benchmark("vs_torchtitan")


@pytest.mark.parametrize("layout", ["single", "fsdp"])
def test_paratrain_commands_are_valid_configs_of_the_matched_llama(script, layout, tmp_path):
    command = script.paratrain_command(
        tmp_path / "run", tmp_path / "corpus", tmp_path / "tokenizer", layout=layout, steps=30, micro_batch=8
    )
    config_path, overrides = command[command.index("train") + 1], command[command.index("train") + 2 :]
    config = load_config(Path(script.REPO_ROOT) / config_path, overrides)
    shape = config.model.args
    assert (shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]) == (2048, 16, 8192)
    assert (shape["num_attention_heads"], shape["num_key_value_heads"], shape["vocab_size"]) == (32, 8, 128256)
    assert config.parallel.strategy == layout and config.parallel.compile and config.precision == "bf16"
    assert (config.train.micro_batch_size, config.train.global_batch_size, config.data.args["block_size"]) == (
        8,
        8,
        2048,
    )


def test_torchtitan_step_lines_parse_and_the_flops_formula_matches_torchtitans(script, tmp_path):
    log = tmp_path / "torchtitan.log"
    log.write_text(TITAN_LINES)
    result = script.torchtitan_result(log, skip_steps=10)
    assert (result.tokens_per_s, result.peak_reserved_gib, result.steps_kept) == (57722, 50.71, 1)
    assert script.FLOPS_PER_TOKEN * 57722 / 1e12 == pytest.approx(474.48, rel=1e-3)


def test_a_log_without_steps_past_the_warm_up_is_an_error(script, tmp_path):
    log = tmp_path / "torchtitan.log"
    log.write_text(TITAN_LINES.splitlines()[0])
    with pytest.raises(RuntimeError, match="no torchtitan step after 10"):
        script.torchtitan_result(log, skip_steps=10)


def test_start_up_milestones_are_read_from_the_stamped_output_of_a_real_run(script, tmp_path):
    """run_stamped stamps each line of a real paratrain run (the quickstart, 2 steps on CPU) as it arrives;
    the milestones come in order and end with step 1, and torchtitan's are read from its own lines."""
    log = tmp_path / "paratrain.log"
    command = [
        sys.executable, "-m", "paratrain.cli", "train", "examples/quickstart.yaml", "train.max_steps=2",
        "log.every_steps=1", f"run.output_dir={tmp_path / 'run'}", "checkpoint.save_final=false",
    ]  # fmt: skip
    assert script.run_stamped(command, log, cwd=Path(script.REPO_ROOT)) == 0
    milestones = script.milestones_of(log, "paratrain")
    assert list(milestones) == ["started", "process group", "model ready", "step 1"]
    assert list(milestones.values()) == sorted(milestones.values()) and milestones["started"] > 0
    titan = tmp_path / "torchtitan.log"
    stamped = [f"[+{seconds:8.2f}s] {line}" for seconds, line in zip((2.5, 6.0, 12.25, 14.0), TITAN_START)]
    titan.write_text("\n".join([*stamped, f"[+   15.00s] {TITAN_LINES.splitlines()[0]}"]) + "\n")
    assert script.milestones_of(titan, "torchtitan") == {
        "started": 2.5, "data ready": 12.25, "model ready": 14.0, "step 1": 15.0,
    }  # fmt: skip
