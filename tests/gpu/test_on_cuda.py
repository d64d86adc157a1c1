"""What the CPU suite cannot run: the parity tables and the CUDA-only features on GPUs.

Every test here skips, naming the devices it needs, on a machine with fewer CUDA devices; the suite
never depends on a GPU. `--gpu-device cpu` runs the same tests on CPU with gloo, which checks these
tests themselves and nothing of the CUDA paths:

    .venv/bin/python -m pytest tests/gpu                    # on a machine with GPUs
    .venv/bin/python -m pytest tests/gpu --gpu-device cpu   # this file's own check, on CPU
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import (
    LayoutRuns,
    checkpoint_weights,
    losses_by_step,
    read_metrics,
    run_cli,
    tiny_config,
    train,
    write_config,
)
from tests.parity.test_sharded_matches_single import LAYOUTS as SHARDED_LAYOUTS

pytestmark = pytest.mark.gpu

STEPS = 20
# Looser than on CPU (1e-5): cuBLAS and NCCL pick reduction orders by shape and process count. A first
# guess, until a GPU run measures the real spread; a wrong reduction (sum for mean) is off by 2x.
LOSS_RTOL = 1e-4
GRADIENT_RTOL = 1e-3
PARITY_LAYOUTS = {
    "single": ([], 1),
    "single fp16": (["precision=fp16"], 1),
    "ddp x2": (["parallel.strategy=ddp"], 2),
    **SHARDED_LAYOUTS,
    # Context parallel's all_to_all exchange over NCCL (ring attention, the CUDA-only exchange, is not
    # driven by paratrain yet; it would need these same 2+ GPUs).
    "cp x2": (["parallel.cp=2"], 2),
    "cp x dp_shard 2x2": (["parallel.cp=2", "parallel.dp_shard=2"], 4),
}


def reference_of(layout: str) -> str:
    """The one-process run a layout must match: fp16 against fp16, whose gradient scaler leaves the dumped
    gradients scaled; emulated float8 against the same float8 on one GPU."""
    for kind in ("fp16", "float8 rowwise", "float8"):
        if kind in layout:
            return f"single {kind}"
    return "single"


# Each multi-process layout of the CPU tables (the moves between layouts excepted: they test
# checkpoints, not devices), with the one-process run it must match.
REFERENCE_OF = {
    name: reference_of(name) for name, (_, nproc) in PARITY_LAYOUTS.items() if nproc > 1 and " to " not in name
}


@pytest.fixture(scope="module")
def device(request) -> str:
    return request.config.getoption("--gpu-device")


def processes(device: str, wanted: int) -> int:
    """wanted, or a skip naming how many CUDA devices there are when fewer."""
    if device == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < wanted:
            pytest.skip(f"needs {wanted} CUDA device(s), this machine has {have} (--gpu-device cpu checks the test)")
    return wanted


@pytest.fixture(scope="module")
def runs(tmp_path_factory, device) -> LayoutRuns:
    # One launch per layout (no `together`): a machine may have GPUs for some process counts only.
    return LayoutRuns(
        tmp_path_factory.mktemp("gpu-parity"),
        PARITY_LAYOUTS,
        train={"max_steps": STEPS, "device": device},
        debug={"dump_gradients_at_steps": [1]},
    )


@pytest.mark.parametrize("layout", REFERENCE_OF)
def test_layout_on_gpus_matches_one_gpu_losses_and_first_gradients(runs, device, layout):
    processes(device, PARITY_LAYOUTS[layout][1])
    single = runs.get(REFERENCE_OF[layout])
    reference, laid_out = losses_by_step(single), losses_by_step(runs.get(layout))
    assert laid_out.keys() == reference.keys()
    assert max(abs(laid_out[s] - reference[s]) / abs(reference[s]) for s in reference) <= LOSS_RTOL
    expected = load_file(str(single / "gradients/step-1.safetensors"))
    actual = load_file(str(runs.get(layout) / "gradients/step-1.safetensors"))
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=GRADIENT_RTOL, atol=1e-6, msg=name)


def run_tiny(tmp_path: Path, device: str, name: str, *overrides: str, nproc: int = 1, env=None, check=True):
    """A tiny GPT's STEPS-step run on device; returns (output_dir, the finished process)."""
    output_dir = tmp_path / name
    config = write_config(tmp_path / f"{name}.yaml", tiny_config(output_dir, train={"max_steps": STEPS}))
    result = train(config, f"train.device={device}", *overrides, nproc=processes(device, nproc), env=env, check=check)
    return output_dir, result


def assert_every_loss_finite(output_dir: Path) -> None:
    losses = [record["loss"] for record in read_metrics(output_dir)]
    assert len(losses) == STEPS and all(loss is not None and math.isfinite(loss) for loss in losses), losses


MIXED_PRECISION = {
    "single bf16": (["precision=bf16"], 1),
    "single fp16": (["precision=fp16"], 1),
    "ddp bf16": (["parallel.strategy=ddp", "precision=bf16"], 2),
    "ddp fp16": (["parallel.strategy=ddp", "precision=fp16"], 2),
    "fsdp bf16 params": (["parallel.strategy=fsdp", "precision=bf16", "parallel.fsdp.param_dtype=bf16"], 2),
    "fsdp fp16": (["parallel.strategy=fsdp", "precision=fp16"], 2),
    "fsdp bf16 compile": (["parallel.strategy=fsdp", "precision=bf16", "parallel.compile=true"], 2),
    "fsdp activation checkpointing": (["parallel.strategy=fsdp", "parallel.activation_checkpointing=true"], 2),
    # Compiled selective checkpointing: inductor's partitioner keeps what the policy saves (parallel/activation.py).
    "fsdp bf16 compile selective checkpointing": (
        [
            "parallel.strategy=fsdp",
            "precision=bf16",
            "parallel.compile=true",
            "parallel.activation_checkpointing=selective",
        ],
        2,
    ),
}


@pytest.mark.parametrize("name", MIXED_PRECISION)
def test_mixed_precision_compile_and_recompute_train_with_finite_losses(tmp_path, device, name):
    overrides, nproc = MIXED_PRECISION[name]
    output_dir, _ = run_tiny(tmp_path, device, name.replace(" ", "-"), *overrides, nproc=nproc)
    assert_every_loss_finite(output_dir)


def float8_overrides(device: str) -> list[str]:
    """What a float8 run adds on this device: torchao's emulation on the CPU (which checks the test itself),
    nothing on a GPU of compute capability 8.9 or newer, a skip saying so on an older one."""
    if device == "cpu":
        return ["parallel.float8.emulate=true"]
    processes(device, 1)
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name()
        pytest.skip(f"float8 matmuls need a CUDA GPU of compute capability 8.9 or newer; {name} has {major}.{minor}")
    return []


FLOAT8_RUNS = {
    "tensorwise": ["parallel.float8.scaling=tensorwise"],
    "rowwise": ["parallel.float8.scaling=rowwise"],
    # FSDP on one GPU still all-gathers (over one rank): the float8 all-gather's own path.
    "tensorwise fsdp": [
        "parallel.float8.scaling=tensorwise",
        "parallel.strategy=fsdp",
        "parallel.fsdp.param_dtype=bf16",
    ],
}
# A first guess until a GPU run measures the spread: float8's e4m3 casts move a tiny model's loss by well under
# 1%; a wrong scale (or float8 applied to the head) moves it by far more, or diverges.
FLOAT8_LOSS_RTOL = 0.02


@pytest.mark.parametrize("name", FLOAT8_RUNS)
def test_a_float8_runs_losses_stay_close_to_bf16s(tmp_path, device, name):
    extra = float8_overrides(device)
    bf16, _ = run_tiny(tmp_path, device, "bf16", "precision=bf16")
    float8, run = run_tiny(
        tmp_path, device, "float8", "precision=bf16", "parallel.float8.enabled=true", *FLOAT8_RUNS[name], *extra
    )
    assert "float8 (" in run.stderr and " on 12 Linear layers of 2 blocks" in run.stderr  # the log of the conversion
    reference, losses = losses_by_step(bf16), losses_by_step(float8)
    assert losses.keys() == reference.keys() and losses != reference
    assert max(abs(losses[s] - reference[s]) / reference[s] for s in reference) <= FLOAT8_LOSS_RTOL
    assert losses[STEPS] < losses[1], "the float8 run did not train"


def test_fsdp_cpu_offload_trains_with_finite_losses(tmp_path, device):
    if device != "cuda":
        pytest.skip("cpu_offload moves parameters from a GPU; preflight refuses it on a CPU run")
    output_dir, _ = run_tiny(
        tmp_path, device, "offload", "parallel.strategy=fsdp", "parallel.fsdp.cpu_offload=true", nproc=2
    )
    assert_every_loss_finite(output_dir)


def test_async_checkpoints_complete_with_their_manifest(tmp_path, device):
    overrides = ("checkpoint.async_save=true", "checkpoint.every_steps=5")
    output_dir, _ = run_tiny(tmp_path, device, "async", *overrides, nproc=2)
    assert (output_dir / f"checkpoints/step-{STEPS}/paratrain-manifest.json").is_file()


def test_a_killed_run_resumed_ends_with_the_weights_of_an_uninterrupted_one(tmp_path, device):
    common = ("parallel.strategy=ddp", "train.deterministic=true", "checkpoint.every_steps=5")
    reference, _ = run_tiny(tmp_path, device, "reference", *common, nproc=2)
    _, killed = run_tiny(
        tmp_path, device, "killed", *common, nproc=2, env={"PARATRAIN_FAULT": "after_step:12:0"}, check=False
    )
    assert killed.returncode != 0, "the fault should end the run"
    resumed, _ = run_tiny(tmp_path, device, "killed", *common, "checkpoint.resume=auto", nproc=2)
    final = f"checkpoints/step-{STEPS}"
    expected, actual = checkpoint_weights(reference / final), checkpoint_weights(resumed / final)
    assert actual.keys() == expected.keys() and all(torch.equal(actual[k], expected[k]) for k in expected)


def test_a_nan_gradient_stops_under_stop_and_is_skipped_under_skip(tmp_path, device):
    nan_at_5 = {"PARATRAIN_FAULT": "nan_grad:5"}
    _, stopped = run_tiny(
        tmp_path, device, "stop", "parallel.strategy=fsdp", "train.nonfinite=stop", "checkpoint.every_steps=4",
        nproc=2, env=nan_at_5, check=False,
    )  # fmt: skip
    assert stopped.returncode == 3, stopped.stderr[-2000:]
    skipped, _ = run_tiny(
        tmp_path, device, "skip", "parallel.strategy=fsdp", "train.nonfinite=skip", nproc=2, env=nan_at_5
    )
    assert read_metrics(skipped)[-1]["skipped_steps"] == 1


def test_the_profiler_writes_a_trace_and_a_memory_snapshot(tmp_path, device):
    output_dir, _ = run_tiny(tmp_path, device, "profile", "profile.enabled=true", "profile.memory_snapshot=true")
    assert any((output_dir / "profile").iterdir())


def test_verify_passes_for_fsdp(tmp_path, device):
    processes(device, 2)
    config = write_config(tmp_path / "verify.yaml", tiny_config(tmp_path / "verify", train={"device": device}))
    result = run_cli(["verify", str(config), "parallel.strategy=fsdp", "--nproc-per-node", "2"], timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


def documents_attended(dtype, inputs, documents, window, *, autocast=False, varlen=True):
    """(output, gradients of q, k, v) of attention within documents, in float32 for comparing."""
    from paratrain.parallel import documents as documents_module

    inputs = [tensor.to(dtype).requires_grad_() for tensor in inputs]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        assert documents_module.takes_varlen(inputs[0], dropout_p=0.0) == (dtype == torch.bfloat16 or autocast)
        with pytest.MonkeyPatch.context() as patch:
            if not varlen:  # the per-length SDPA calls, in the same precision
                patch.setattr(documents_module, "takes_varlen", lambda query, dropout_p: False)
            out = documents_module.document_attention(*inputs, documents, sliding_window=window)
    out.float().square().sum().backward()
    return [out.float()] + [tensor.grad.float() for tensor in inputs]


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("window", [None, 3])
def test_attention_within_documents_in_one_variable_length_call_is_as_close_as_per_length_calls(
    device, window, autocast
):
    """bf16 (or float32 under bf16 autocast, as rotary embeddings hand it over) takes flash attention's
    variable-length call. Against float32's per-length calls (each document alone, checked on CPU), its output
    and gradients must be as close as bf16's own per-length calls are, within 2x (bf16 rounding alone moves
    these gradients by ~0.1 of ~50). Grouped-query heads, and a window that cuts into the longer documents."""
    if device != "cuda" or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device with flash attention")
    torch.manual_seed(0)
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2] * 4, [0] * 20 + [1] * 11 + [2]], device="cuda")
    inputs = [torch.randn(2, heads, 32, 64, device="cuda") for heads in (8, 2, 2)]
    half = torch.float32 if autocast else torch.bfloat16
    varlen = documents_attended(half, inputs, documents, window, autocast=autocast)
    per_length = documents_attended(half, inputs, documents, window, autocast=autocast, varlen=False)
    reference = documents_attended(torch.float32, inputs, documents, window)
    for name, got, baseline, exact in zip(("output", "dq", "dk", "dv"), varlen, per_length, reference, strict=True):
        error, baseline_error = ((tensor - exact).abs().max().item() for tensor in (got, baseline))
        assert error <= 2 * baseline_error + 1e-3, f"{name}: {error:.4f} against per-length calls' {baseline_error:.4f}"
