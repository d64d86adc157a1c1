"""Two nodes on separate network hosts: two network namespaces joined by a veth pair, each with its
own address, run ``paratrain train --nnodes 2 --nproc-per-node 2``. No traffic leaves them: each
namespace has only its loopback and its end of the pair."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.harness import (
    REPO_ROOT,
    checkpoint_weights,
    losses_by_step,
    max_relative_difference,
    max_weight_difference,
    read_metrics,
    tiny_config,
    train,
    write_config,
)

STEPS = 20
EVERY = 10
LOSS_RTOL = 1e-5  # as the parity tests
WEIGHT_ATOL = 1e-5
SUBNET = "10.231.0"


@dataclass(frozen=True)
class Host:
    """One network namespace acting as a machine: its name, interface and address."""

    namespace: str
    interface: str
    address: str


@pytest.fixture(scope="module")
def hosts():
    """Two namespaces joined by a veth pair (names carry the pid: parallel runs do not clash)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's ip command is not installed")
    tag = f"pt{os.getpid()}"
    made = [Host(f"{tag}n{i}", f"{tag}v{i}", f"{SUBNET}.{i + 1}") for i in (0, 1)]
    try:
        _make_hosts(made)
    except subprocess.CalledProcessError as error:
        _remove_hosts(made)
        pytest.skip(f"cannot make network namespaces here: {error.stderr.strip()}")
    yield made
    _remove_hosts(made)


def _make_hosts(made: list[Host]) -> None:
    first, second = made
    _ip("link", "add", first.interface, "type", "veth", "peer", "name", second.interface)
    for host in made:
        _ip("netns", "add", host.namespace)
        _ip("link", "set", host.interface, "netns", host.namespace)
        _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
        _ip("-n", host.namespace, "link", "set", "lo", "up")
        _ip("-n", host.namespace, "link", "set", host.interface, "up")


def _remove_hosts(made: list[Host]) -> None:
    # Deleting a namespace deletes the veth end inside it, and with it the pair.
    for host in made:
        subprocess.run(["ip", "netns", "delete", host.namespace], capture_output=True)
    subprocess.run(["ip", "link", "delete", made[0].interface], capture_output=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def config_for(root: Path, name: str) -> Path:
    config = tiny_config(
        root / name,
        train={"max_steps": STEPS},
        parallel={"strategy": "ddp"},
        checkpoint={"every_steps": EVERY},
        log={"every_steps": 1},
    )
    return write_config(root / f"{name}.yaml", config)


def train_on_two_nodes(
    hosts: list[Host], config: Path, *extra: str, port: int, fault_on_node_1: str | None = None
) -> list[str]:
    """``paratrain train`` on both hosts (2 processes each), node 0's address as the endpoint;
    returns each node's stderr once both launchers succeeded."""
    nodes = []
    for rank, host in enumerate(hosts):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": host.interface}
        if rank == 1 and fault_on_node_1:
            env["PARATRAIN_FAULT"] = fault_on_node_1
        argv = [
            "ip",
            "netns",
            "exec",
            host.namespace,
            sys.executable,
            "-m",
            "paratrain.cli",
            "train",
            str(config),
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--node-rank",
            str(rank),
            "--rdzv-endpoint",
            f"{hosts[0].address}:{port}",
            *extra,
        ]
        nodes.append(
            subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
        )
    stderrs = []
    for rank, node in enumerate(nodes):
        try:
            _, stderr = node.communicate(timeout=240)
        finally:
            for other in nodes:
                if other.poll() is None and node.returncode != 0:
                    other.kill()
        assert node.returncode == 0, f"node {rank} failed ({node.returncode}):\n{stderr[-4000:]}"
        stderrs.append(stderr)
    return stderrs


@dataclass(frozen=True)
class KilledRun:
    output_dir: Path
    node_0_stderr: str

    def losses_by_attempt(self) -> tuple[dict[int, float], dict[int, float]]:
        """Losses logged before the kill, and after the restart (steps are logged again from the resumed one)."""
        records = read_metrics(self.output_dir)
        restart = next(i for i in range(1, len(records)) if records[i]["step"] <= records[i - 1]["step"])
        return ({r["step"]: r["loss"] for r in records[:restart]}, {r["step"]: r["loss"] for r in records[restart:]})


@pytest.fixture(scope="module")
def killed_run(hosts, tmp_path_factory) -> KilledRun:
    """2 nodes x 2 processes with --max-restarts 1, and a SIGKILL of global rank 3 (node 1's second
    worker) after step 15, 5 steps past the step-10 checkpoint. Node 0's workers see their peer
    vanish; both launchers restart their group, which resumes from step 10."""
    root = tmp_path_factory.mktemp("two-nodes")
    node_0, _ = train_on_two_nodes(
        hosts, config_for(root, "killed"), "--max-restarts", "1", port=29500, fault_on_node_1="after_step:15:3"
    )
    return KilledRun(root / "killed", node_0)


@pytest.fixture(scope="module")
def one_node_run(tmp_path_factory) -> Path:
    """The same config on one node of four processes."""
    root = tmp_path_factory.mktemp("one-node")
    train(config_for(root, "one_node"), nproc=4)
    return root / "one_node"


def test_two_nodes_of_two_processes_train_like_one_node_of_four(killed_run, one_node_run):
    before_kill, _ = killed_run.losses_by_attempt()
    assert sorted(before_kill) == list(range(1, 16))
    assert read_metrics(killed_run.output_dir)[0]["world_size"] == 4
    one_node = {step: loss for step, loss in losses_by_step(one_node_run).items() if step in before_kill}
    assert max_relative_difference(before_kill, one_node) <= LOSS_RTOL
    final = f"checkpoints/step-{STEPS}"
    difference = max_weight_difference(
        checkpoint_weights(killed_run.output_dir / final), checkpoint_weights(one_node_run / final)
    )
    assert difference <= WEIGHT_ATOL


def test_worker_killed_on_node_1_is_restarted_on_both_nodes_and_ends_bit_identical(killed_run, one_node_run):
    resumed_at = int(re.search(r"resumed from \S+ at step (\d+)", killed_run.node_0_stderr).group(1))
    assert resumed_at == EVERY
    before_kill, after_restart = killed_run.losses_by_attempt()
    assert sorted(after_restart) == list(range(EVERY + 1, STEPS + 1))
    redone = range(EVERY + 1, 16)  # steps 11-15 ran in both attempts: the same losses to the last bit
    assert {step: after_restart[step] for step in redone} == {step: before_kill[step] for step in redone}
    # An uninterrupted 2 x 2 run and the 1 x 4 run sum gradients over the same ranks in the same order
    # and end bit-identical (measured), so the one-node run serves as the uninterrupted reference.
    final = f"checkpoints/step-{STEPS}"
    expected, actual = checkpoint_weights(one_node_run / final), checkpoint_weights(killed_run.output_dir / final)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), f"{name} differs from the uninterrupted run"
