"""The memory check before allocating and ``parallel.strategy: auto``, through the real CLI in this process:
a model too large for this machine is refused in seconds from its estimate on the meta device (it is never
allocated), and auto trains the layout the planner recommends for the world size."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import torch
import yaml

from paratrain.config.loading import validate_config
from paratrain.parallel.dims import MESH_DIMS, ParallelDims
from paratrain.planner.memory_check import (
    FreeMemory,
    check_host_memory_fits,
    check_memory,
    check_memory_fits,
    free_memory,
    resolve_auto_layout,
)
from tests.harness import read_metrics, run_cli_in_process, tiny_config, write_config

# One block of this GPT holds 12 x 2560^2 parameters: 16 bytes each with AdamW (weights, gradients, two moments).
WIDE = {"vocab_size": 50304, "block_size": 64, "n_head": 32, "n_embd": 2560}
BYTES_PER_BLOCK = 16 * 12 * 2560**2


def gpt_too_large_for_this_machine(tmp_path: Path) -> Path:
    """A GPT of a few billion parameters, with enough blocks that it cannot fit the RAM this machine has free."""
    free = free_memory(torch.device("cpu"), local_world_size=1).bytes
    n_layer = max(32, free // BYTES_PER_BLOCK + 4)  # 32 blocks: 2.8B parameters
    model = {"factory": "paratrain.models.gpt:build_gpt", "args": {**WIDE, "n_layer": n_layer}}
    data = {"args": {"block_size": 64, "max_chars": 40_000}}
    config = tiny_config(tmp_path / "run", model=model, data=data, train={"device": "cpu"})
    return write_config(tmp_path / "config.yaml", config)


def test_a_gpt_too_large_for_this_machine_is_refused_from_its_estimate_before_allocating(tmp_path):
    config = gpt_too_large_for_this_machine(tmp_path)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    code, stderr = run_cli_in_process(["train", str(config)])
    # Built on meta or not at all: its parameters alone would be over 10 GiB of this process's memory.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 2 * 2**20
    assert code == 2 and "Traceback" not in stderr, stderr
    assert "does not fit: the layout single needs an estimated" in stderr
    assert "is free (MemAvailable in /proc/meminfo)" in stderr
    assert f"run it: paratrain train {config} --nproc-per-node 1 --nnodes" in stderr
    assert "--skip-memory-check" in stderr and "train.check_memory=false" in stderr
    assert not (tmp_path / "run").exists()  # refused before the trainer made its output directory


def test_on_cpu_several_processes_are_refused_once_before_the_launch(tmp_path):
    # The node's processes share its RAM: the CLI checks for all of them before starting any.
    config = gpt_too_large_for_this_machine(tmp_path)
    code, stderr = run_cli_in_process(["train", str(config), "--nproc-per-node", "2"])
    assert code == 2 and "Traceback" not in stderr, stderr
    assert "the layout ddp dp_replicate=2 needs an estimated" in stderr
    assert "/ 2 processes on this node" in stderr and "rank 0 failed" not in stderr


def test_a_node_without_the_host_memory_its_processes_need_is_refused_before_the_launch(tmp_path):
    config = write_config(tmp_path / "config.yaml", tiny_config(tmp_path / "run", train={"device": "cpu"}))
    # Two CPU processes of 360 MiB of runtime each cannot share 600 MB: refused once, by the launcher.
    code, stderr = run_cli_in_process(["train", str(config), "--nproc-per-node", "2", "train.host_memory=600MB"])
    assert code == 2 and "Traceback" not in stderr, stderr
    assert "the layout ddp dp_replicate=2 needs an estimated " in stderr
    assert "of host memory per node, but only 572 MiB is available (train.host_memory): 2 CPU process(es) x " in stderr
    assert "set train.host_memory=SIZE" in stderr and "--skip-memory-check" in stderr
    assert "rank 0 failed" not in stderr and not (tmp_path / "run").exists()


def test_the_host_memory_of_a_node_is_checked_by_its_local_rank_0_only():
    config = validate_config(tiny_config(Path("runs/x"), train={"device": "cpu", "host_memory": "1MB"}))
    dims = ParallelDims("ddp", dp_replicate=2)
    with pytest.raises(ValueError, match="of host memory per node, but only 977 KiB is available"):
        check_memory(config, dims, rank=0, local_rank=0, local_world_size=2, config_path="c.yaml")
    # The node's other processes share the same RAM: they check their own device's share, not the node's.
    verdict = check_memory(config, dims, rank=1, local_rank=1, local_world_size=2, config_path="c.yaml")
    assert verdict.startswith("memory check: ") and "host memory" not in verdict


def test_a_gpu_runs_host_memory_is_checked_against_the_nodes_ram():
    # On GPUs the model state lives on the devices; the node's RAM holds the runtimes and the model's init.
    config = validate_config(tiny_config(Path("runs/x"), model={"args": {**WIDE, "n_layer": 4}}))
    dims = ParallelDims("fsdp", dp_shard=8)
    estimate = check_memory_fits(config, dims, FreeMemory(2**50, "plenty"), nnodes=1, device="cuda")
    node = check_host_memory_fits(config, estimate, FreeMemory(2**50, "plenty"))
    assert node.device == "cuda" and node.other.training == 0 and node.per_node > 8 * 2 * 2**30
    with pytest.raises(ValueError, match=r"needs an estimated .* of host memory per node, .* 8 GPU process\(es\)"):
        check_host_memory_fits(config, estimate, FreeMemory(node.per_node - 1, "test"))


def test_skip_memory_check_starts_without_the_check(tmp_path):
    config = write_config(tmp_path / "config.yaml", tiny_config(tmp_path / "run", train={"max_steps": 1}))
    code, stderr = run_cli_in_process(["train", str(config), "--skip-memory-check"])
    assert code == 0, stderr
    assert len(read_metrics(tmp_path / "run")) == 1
    # An override, so the workers a launch starts skip it too.
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["train"]["check_memory"] is False


def test_the_refusal_names_the_planners_layout_that_fits_these_processes():
    config = validate_config(tiny_config(Path("runs/x"), model={"args": {**WIDE, "n_layer": 4}}))
    ddp = ParallelDims("ddp", dp_replicate=4)
    needed = check_memory_fits(config, ddp, FreeMemory(2**50, "plenty"), nnodes=1).peak.total
    with pytest.raises(ValueError) as refused:  # a third of what DDP needs: only sharding fits
        check_memory_fits(config, ddp, FreeMemory(needed // 3, "test"), nnodes=1, config_path="gpt.yaml")
    message = str(refused.value)
    assert "the layout ddp dp_replicate=4 needs an estimated" in message
    assert "The planner's layout that fits with these processes: " in message
    assert "parallel.dp_replicate=4" not in message.splitlines()[1]  # not the replicas that did not fit
    assert "run it: paratrain train gpt.yaml --nproc-per-node 4 --nnodes 1 parallel.strategy=" in message


def test_auto_chooses_a_layout_that_fits_when_replicas_do_not():
    config = validate_config(
        tiny_config(Path("runs/x"), model={"args": {**WIDE, "n_layer": 4}}, parallel={"strategy": "auto"})
    )
    explicit = config.model_copy(update={"parallel": config.parallel.model_copy(update={"strategy": None})})
    ddp = ParallelDims("ddp", dp_replicate=2)
    replicas_need = check_memory_fits(explicit, ddp, FreeMemory(2**50, "plenty"), nnodes=1).peak.total
    memory = FreeMemory(replicas_need * 2 // 3, "test")
    with pytest.raises(ValueError, match="does not fit"):
        check_memory_fits(explicit, ddp, memory, nnodes=1)
    chosen = resolve_auto_layout(config, world_size=2, nnodes=1, memory=memory.bytes).parallel
    dims = ParallelDims(chosen.strategy, **{name: getattr(chosen, name) for name in MESH_DIMS})
    assert dims.world_size == 2 and chosen.strategy != "auto"
    assert check_memory_fits(explicit, dims, memory, nnodes=1).peak.total <= memory.bytes


def test_auto_trains_the_planners_layout_in_one_process(tmp_path):
    config = write_config(tmp_path / "config.yaml", tiny_config(tmp_path / "run", train={"max_steps": 2}))
    code, stderr = run_cli_in_process(["train", str(config), "parallel.strategy=auto"])
    assert code == 0, stderr
    assert "parallel.strategy=auto: training with the planner's layout single" in stderr
    assert len(read_metrics(tmp_path / "run")) == 2


def test_auto_on_two_processes_resolves_to_a_layout_every_check_accepts(tmp_path, capsys):
    # The dry run builds the mesh and the layout for both ranks in this process (a fake process group).
    config = write_config(tmp_path / "config.yaml", tiny_config(tmp_path / "run"))
    code, stderr = run_cli_in_process(
        ["train", str(config), "parallel.strategy=auto", "--nproc-per-node", "2", "--dry-run"]
    )
    assert code == 0, stderr
    assert "2 ranks (1 node(s) x 2), layout ddp: pp=1 x dp_replicate=2" in capsys.readouterr().out
