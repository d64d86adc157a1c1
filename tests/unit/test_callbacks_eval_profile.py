"""Callbacks, evaluation, early stopping, the memory and throughput monitors and the profiler, on one
process in the test process itself (the 2-rank versions: tests/distributed/test_callbacks_on_every_rank.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import paratrain
from paratrain.callbacks.throughput import peak_flops_of
from paratrain.checks.preflight import preflight
from paratrain.config.loading import load_config
from paratrain.data.regression import build_regression_dataset
from paratrain.errors import ConfigError
from paratrain.losses import mse
from paratrain.models.gpt import build_gpt
from paratrain.models.mlp import build_mlp
from tests.distributed.recording_callback import RecordingCallback
from tests.harness import read_metrics

MODEL_ARGS = {"in_features": 4, "hidden_features": 8, "num_hidden_layers": 2}
VALIDATION = {"size": 37, "in_features": 4, "seed": 99}


def mlp_overrides(output_dir: Path) -> list[str]:
    return [
        f"run.output_dir={output_dir}",
        "checkpoint.resume=never",
        "train.max_steps=6",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "log.every_steps=3",
        "checkpoint.every_steps=3",
        "model.factory=paratrain.models.mlp:build_mlp",
        f"model.args={MODEL_ARGS}",
        "loss.factory=paratrain.losses:mse",
        "data.factory=paratrain.data.regression:build_regression_dataset",
        "data.args={size: 64, in_features: 4}",
    ]


# Evaluation reads 3 batches of 5 (15 of the 37 samples); early stopping with a min_delta no step can
# beat ends the run at the second evaluation, step 4.
RUN_OVERRIDES = [
    "eval.factory=paratrain.data.regression:build_regression_dataset",
    f"eval.args={VALIDATION}",
    "eval.every_steps=2",
    "eval.batch_size=5",
    "eval.max_batches=3",
    "profile.enabled=true",
    "profile.wait=1",
    "profile.warmup=1",
    "profile.active=2",
    "callbacks=[{factory: 'paratrain.callbacks.memory:MemoryMonitor'}, "
    "{factory: 'paratrain.callbacks.throughput:ThroughputMonitor'}, "
    "{factory: 'paratrain.callbacks.early_stopping:EarlyStopping', args: {monitor: eval_loss, patience: 1, min_delta: 100}}]",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, RecordingCallback, paratrain.TrainResult]:
    output_dir = tmp_path_factory.mktemp("single") / "run"
    recorder = RecordingCallback(
        model_factory=lambda: build_mlp(**MODEL_ARGS),
        validation=build_regression_dataset(**VALIDATION),
        loss_fn=mse(),
        max_samples=15,
    )
    trainer = paratrain.Trainer(load_config(None, [*mlp_overrides(output_dir), *RUN_OVERRIDES]), callbacks=[recorder])
    try:
        result = trainer.train()
    finally:
        trainer.close()
    return output_dir, recorder, result


def test_callbacks_fire_in_order_and_only_at_their_steps(run):
    _, recorder, _ = run
    assert recorder.events == [
        ["train_start", 0, None],
        ["step_end", 1, "logged"],
        ["evaluation", 2, None],
        ["step_end", 2, "logged"],
        ["step_end", 3, "logged"],
        ["checkpoint_saved", 3, "step-3"],
        ["evaluation", 4, None],
        ["step_end", 4, "logged"],
        ["checkpoint_saved", 4, "step-4"],
        ["train_end", 4, None],
    ]


def test_the_trainer_passed_to_callbacks_has_every_attribute_their_view_promises(run):
    _, recorder, _ = run
    assert recorder.missing_from_view == []


def test_early_stopping_ends_the_run_with_a_final_checkpoint(run):
    output_dir, _, result = run
    assert result.steps == 4 and result.last_checkpoint == output_dir / "checkpoints" / "step-4"
    assert [record["step"] for record in read_metrics(output_dir)] == [1, 2, 3, 4]


def test_eval_loss_equals_the_loss_computed_by_hand_over_the_evaluated_samples(run):
    output_dir, recorder, _ = run
    assert [e["step"] for e in recorder.evaluations] == [2, 4]
    records = {record["step"]: record for record in read_metrics(output_dir)}
    logged = {step: record.get("eval_loss") for step, record in records.items()}
    for e in recorder.evaluations:
        assert e["eval_loss"] == pytest.approx(e["by_hand"], rel=1e-6)
        assert logged[e["step"]] == e["eval_loss"]
        assert 0 < records[e["step"]]["eval_time_s"] < 10
    assert logged[1] is None and logged[3] is None  # logged beside training metrics only where evaluated


def test_memory_and_throughput_fields_are_logged_at_every_log_step(run):
    output_dir, _, _ = run
    parameters = sum(p.numel() for p in build_mlp(**MODEL_ARGS).parameters())
    records = read_metrics(output_dir)
    assert [record["step"] for record in records] == [1, 2, 3, 4]
    for record in records:
        assert 0 < record["mem_rss_mb_min"] == record["mem_rss_mb_max"]  # one rank
        assert record["mem_peak_rss_mb_max"] >= record["mem_rss_mb_max"]
        # 6·N FLOPs per sample for a model that states none (its inputs are not tokens).
        assert record["flops_per_s"] == pytest.approx(6 * parameters * record["samples_per_s"])
        assert "mfu" not in record


def test_profiler_writes_a_trace_that_parses_with_the_window_steps(run):
    output_dir, _, _ = run
    trace = json.loads((output_dir / "profile" / "trace-rank0.json").read_text())
    steps = {event["name"] for event in trace["traceEvents"] if event.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}
    assert len(trace["traceEvents"]) > 100  # operators, not only the step markers


def test_gpt_flops_per_token_counts_non_embedding_matmuls_and_attention():
    model = build_gpt(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=8)
    d, layers = 8, 2
    per_block = (4 * d * d + 4 * d) + (8 * d * d + 5 * d) + 4 * d  # attention, MLP, two LayerNorms
    non_embedding = layers * per_block + 2 * d + d * 50  # final norm, LM head
    assert model.flops_per_token(16) == 6 * non_embedding + 12 * layers * d * 16


@pytest.mark.parametrize(
    ("name", "dtype", "tf32", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", False, 989e12),
        ("NVIDIA H100 PCIe", "bf16", False, 756e12),
        ("NVIDIA H200", "fp32", False, 67e12),
        ("NVIDIA H200", "fp32", True, 494e12),
        ("NVIDIA A100-SXM4-80GB", "fp16", False, 312e12),
        ("Tesla T4", "bf16", False, None),
    ],
)
def test_peak_flops_come_from_the_device_name_and_compute_dtype(name, dtype, tf32, peak):
    assert peak_flops_of(name, dtype, tf32=tf32) == peak


PREFLIGHT_CASES = {
    "callback path that does not import": (
        ["callbacks=[{factory: 'no_such_package.cb:Monitor'}]"],
        1,
        ["callbacks[0].factory", "no_such_package", "does not import"],
    ),
    "callback class without the hooks": (
        ["callbacks=[{factory: 'argparse:Namespace'}]"],
        1,
        [
            "callbacks[0].factory='argparse:Namespace' is not a callback",
            "lacks on_train_start, on_step_end",
            "subclass paratrain.callbacks.Callback",
        ],
    ),
    "two bad callbacks, both reported": (
        ["callbacks=[{factory: 'no_such_package.cb:Monitor'}, {factory: 'argparse:Namespace'}]"],
        1,
        [
            "callbacks[0].factory='no_such_package.cb:Monitor'",
            "callbacks[1].factory='argparse:Namespace' is not a callback",
        ],
    ),
    "callback argument it does not take": (
        ["callbacks=[{factory: 'paratrain.callbacks.early_stopping:EarlyStopping', args: {patient: 3}}]"],
        1,
        ["callbacks[0].args", "patient", "it accepts: monitor, patience"],
    ),
    "evaluation under pipeline parallel": (
        ["parallel.strategy=pp", "eval.factory=paratrain.data.regression:build_regression_dataset"],
        2,
        ["evaluation is not supported with pipeline parallel (parallel.pp=2)"],
    ),
    "eval factory argument it does not take": (
        ["eval.factory=paratrain.data.regression:build_regression_dataset", "eval.args={rows: 3}"],
        1,
        ["eval.args", "rows"],
    ),
}


@pytest.mark.parametrize("case", PREFLIGHT_CASES)
def test_bad_callback_and_eval_input_fails_in_preflight_naming_the_key(tmp_path, case):
    overrides, world_size, expected = PREFLIGHT_CASES[case]
    with pytest.raises(ConfigError) as error:
        preflight(
            load_config(None, [*mlp_overrides(tmp_path / "run"), *overrides]),
            world_size=world_size,
            nproc_per_node=world_size,
        )
    for text in expected:
        assert text in str(error.value)


def test_a_profiler_window_longer_than_the_run_is_refused_naming_the_keys(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"profile.wait=1 \+ profile.warmup=1 \+ profile.active=5 = 7 steps is longer "
        r"than train.max_steps=6",
    ):
        load_config(None, [*mlp_overrides(tmp_path), "profile.enabled=true", "profile.active=5"])


@pytest.mark.parametrize(
    ("overrides", "callbacks", "expected"),
    [
        (
            ["callbacks=[{factory: 'paratrain.losses:mse'}]"],
            [],
            "callbacks[0].factory='paratrain.losses:mse' is not a callback",
        ),
        (
            ["callbacks=[{factory: 'paratrain.callbacks.early_stopping:EarlyStopping', args: {patience: 0}}]"],
            [],
            "callbacks[0].args: paratrain.callbacks.early_stopping:EarlyStopping refused {'patience': 0}",
        ),
        ([], [object()], "Trainer(callbacks=[...])[0]='object' is not a callback"),
    ],
)
def test_the_trainer_refuses_an_object_that_is_not_a_callback_before_training(tmp_path, overrides, callbacks, expected):
    # A factory function's result (not checkable in preflight) and the Python API's callbacks.
    with pytest.raises(ConfigError) as error:
        paratrain.Trainer(load_config(None, [*mlp_overrides(tmp_path / "run"), *overrides]), callbacks=callbacks)
    assert expected in str(error.value)
    assert not (tmp_path / "run").exists()
    assert torch.distributed.is_initialized() is False


def test_eval_and_profile_options_without_their_switch_are_warned_about():
    from paratrain.checks.warnings import ineffective_options
    from paratrain.parallel.dims import resolve_parallel_dims

    config = load_config(None, ["eval.every_steps=5", "profile.active=3"])
    warnings = ineffective_options(config, resolve_parallel_dims(config.parallel, world_size=1))
    assert "eval.every_steps has no effect without eval.factory (Python API: Trainer(eval_dataset=...))" in warnings
    assert "profile.active has no effect without profile.enabled=true" in warnings


def test_a_model_its_factory_returns_in_eval_mode_trains_in_training_mode(tmp_path):
    """transformers' from_pretrained returns a model in eval mode: paratrain trains it with dropout on, as the HF
    Trainer does, and evaluation still runs in eval mode."""
    config = load_config(None, [*mlp_overrides(tmp_path / "run"), *RUN_OVERRIDES])
    trainer = paratrain.Trainer(config, model_factory=lambda: build_mlp(**MODEL_ARGS).eval())
    try:
        assert all(module.training for module in trainer.bare_model.modules())
    finally:
        trainer.close()
