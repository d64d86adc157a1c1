"""The host memory (RAM) per process and per node the planner counts for a layout (planner/host_memory.py),
against the bytes counted by hand, and as `paratrain plan` prints it."""

from __future__ import annotations

import pytest

from paratrain.cli import main
from paratrain.config.loading import load_config
from paratrain.parallel.dims import ParallelDims
from paratrain.planner.host_memory import HostMemory
from paratrain.planner.inputs import plan_inputs
from paratrain.planner.model_facts import read_model_facts
from paratrain.planner.ranking import estimate_layout
from tests.harness import REPO_ROOT

GIB = 2**30
# tests.tools.planner_models:build_plain_mlp: 9,729 fp32 parameters, the largest tensor 64 x 64.
WHOLE, LARGEST = 4 * 9729, 4 * 64 * 64
# Its shard on each of 4 FSDP ranks (dim 0 cut in 4, padded up): 16x20 + 16 + 2 x (16x64 + 16) + 1x64 + 1.
SHARD = 4 * (16 * 20 + 16 + 2 * (16 * 64 + 16) + 64 + 1)
ADAMW = 2 * SHARD + 4 * 8  # two moments per parameter and a step counter per tensor


def plain_mlp_estimate(dims: ParallelDims, *overrides: str, device: str = "cuda"):
    config = load_config(
        None,
        [
            "model.factory=tests.tools.planner_models:build_plain_mlp",
            "data.factory=paratrain.data.regression:build_regression_dataset",
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
            *overrides,
        ],
    )
    facts = read_model_facts(config.model)
    return estimate_layout(facts, plan_inputs(config), dims, gpus_per_node=4, measured_per_sample=None, device=device)


def test_a_sharded_gpu_run_holds_its_shard_and_one_tensor_and_rank_0_builds_the_whole_model():
    estimate = plain_mlp_estimate(ParallelDims("fsdp", dp_shard=4), "checkpoint.async_save=true")
    node = estimate.host
    # Every process: its shard and the largest tensor at init and resume; async save's copy while training.
    assert node.other == HostMemory(
        runtime=2 * GIB, init=SHARD + LARGEST, resume=SHARD + LARGEST, training=SHARD + ADAMW
    )
    assert node.other.total == 2 * GIB + SHARD + ADAMW  # the async copy outweighs the shard and a tensor
    # Rank 0 builds the whole model (no init_parameter hook): its fullest moment is that build.
    assert node.first.init == WHOLE and node.first.total == 2 * GIB + WHOLE and node.first.fullest_phase == "init"
    assert node.per_node == 2 * GIB + WHOLE + 3 * (2 * GIB + SHARD + ADAMW)


def test_an_unsharded_layout_builds_the_whole_model_on_every_process():
    node = plain_mlp_estimate(ParallelDims("ddp", dp_replicate=4)).host
    # Resume: the whole model (each process's shard under ddp) plus DCP's read buffer of one tensor.
    assert node.first == node.other == HostMemory(2 * GIB, init=WHOLE, resume=WHOLE + LARGEST, training=0)
    assert node.per_node == 4 * (2 * GIB + WHOLE + LARGEST)
    never = plain_mlp_estimate(ParallelDims("ddp", dp_replicate=4), "checkpoint.resume=never").host
    assert never.per_node == 4 * (2 * GIB + WHOLE)


def test_a_cpu_run_holds_its_whole_estimate_in_host_memory_and_a_gpu_run_with_offload_its_model_state():
    cpu = plain_mlp_estimate(ParallelDims("fsdp", dp_shard=4), "checkpoint.async_save=true", device="cpu")
    assert cpu.host.other.runtime == 360 * 2**20
    assert cpu.host.other.training == cpu.peak.total + SHARD + ADAMW  # parameters, gradients, state, working
    offload = plain_mlp_estimate(ParallelDims("fsdp", dp_shard=4), "parallel.fsdp.cpu_offload=true").host
    assert offload.other.training == SHARD + SHARD + ADAMW  # parameters, gradients and optimizer state


def test_plan_prints_the_host_memory_per_node_of_the_recommended_layout_against_host_memory(capsys):
    pytest.importorskip("transformers")
    config = str(REPO_ROOT / "examples/hf_llama.yaml")
    assert main(["plan", config, "--gpus", "2", "--gpu-memory", "80GB", "--host-memory", "64GB"]) == 0
    out = capsys.readouterr().out
    assert "host memory 59.60 GiB per node (--host-memory)" in out and " host/node " in out
    # A transformers model from scratch under ddp: each process builds it whole (90,432 parameters).
    assert "host memory of ddp dp_replicate=2: 4.00 GiB per node of 59.60 GiB: fits; 2 GPU process(es) x " in out
    # Too little host memory: every layout that fits the GPUs is refused, and the output says which memory.
    assert main(["plan", config, "--gpus", "2", "--gpu-memory", "80GB", "--host-memory", "3GiB"]) == 1
    out = capsys.readouterr().out
    assert "no layout fits: 5 fit in 67.06 GiB per GPU, but none in 3.00 GiB of host memory per node" in out
    assert "no: host" in out and "Pass --host-memory with the nodes' RAM" in out
