"""Two nodes on separate network hosts: two network namespaces joined by a veth pair, each with its
own address, run ``paratrain train --nnodes 2 --nproc-per-node 2``. No traffic leaves them: each
namespace has only its loopback and its end of the pair."""

from __future__ import annotations

import contextlib
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


@pytest.mark.timeout(900)
@pytest.mark.parametrize("killed", ["on both hosts", "on host 1 only"])
def test_replica_groups_spanning_two_nodes_heal_node_to_node_and_train_as_one_process(hosts, tmp_path, killed):
    """Two replica groups of fsdp x2, each spanning both hosts (one process per node: its own torchrun over
    both, its own rendezvous port), a lighthouse on host 0. Group 1 dies after step 6 on both hosts (as a
    group does when its job is preempted), or only its worker on host 1 dies (its worker on host 0 must then
    end too, to be restarted beside it), and each host's torchrun restarts its part; group 0 computes both
    groups' slices meanwhile, and group 1 heals from it rank by rank across the hosts (each host advertises
    its own name, as cluster nodes do). Every logged loss and the final weights are those of one process
    training the same global batch."""
    pytest.importorskip("torchft", reason="replica groups need the ft extra: pip install 'paratrain[ft]'")
    lighthouse_port, steps = 29610, 20
    ft = {"lighthouse": f"http://{hosts[0].address}:{lighthouse_port}", "quorum_timeout_s": 360}
    sections = {"parallel": {"dp_shard": 2, "fault_tolerance": ft}, "train": {"max_steps": steps}}
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "ft", **sections))
    with named_hosts(hosts):
        started = [on_host(hosts[0], ["lighthouse", "--bind", f"{hosts[0].address}:{lighthouse_port}"], tmp_path)]
        try:
            # Group 0 takes half a second a step while group 1 is away and waits for it at step 15, so that
            # group 1 heals from a group still training however slow its restart is here.
            # Group 1's rank 0 comes back 8 s after its peer: the peer must wait for the new Manager's
            # address, not read the one its failed attempt left in the store.
            kill = "after_step:6" if killed == "on both hosts" else "after_step:6:1"
            # It also waits for group 1 at steps 2-6, so that group 1, however late, takes the step it dies after.
            faults = {
                0: "wait_for_groups:2-6,slow_step:7-20,wait_for_groups:15",
                1: f"{kill},late_manager_on_restart:0:0",
            }
            for group in (0, 1):
                for rank, host in enumerate(hosts):
                    args = ["train", str(config), "--replica-group", str(group), "--replica-groups", "2",
                            "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
                            "--rdzv-endpoint", f"{hosts[0].address}:{29620 + group}", "--max-restarts", "1"]  # fmt: skip
                    started.append(on_host(host, args, tmp_path, fault=faults[group]))
            logs = [wait_for(process, log) for process, log in started[1:]]
        finally:
            for process, _ in started:
                if process.poll() is None:
                    process.kill()
    assert "healed from a live replica group" in logs[2] + logs[3]
    if killed == "on host 1 only":
        # Group 1's worker on host 0 ended too (its collectives with the dead peer failed, or the peer-restart watch
        # ended it) and was restarted beside it.
        assert logs[2].count("replica group 1 of 2 (torchft)") == 2
    single = tmp_path / "single"
    train(config, f"run.output_dir={single}", "parallel.dp_shard=1")
    reference, final = losses_by_step(single), f"checkpoints/step-{steps}"
    groups = [tmp_path / "ft/replica-group-0", tmp_path / "ft/replica-group-1"]
    assert [record["step"] for record in read_metrics(groups[0])] == list(range(1, steps + 1))  # each step once
    for group in groups:  # group 1 logs none of the steps it was away for
        records = read_metrics(group)
        assert max(abs(r["loss"] - reference[r["step"]]) / reference[r["step"]] for r in records) <= LOSS_RTOL
        assert {record["skipped_samples"] for record in records} == {0}
        difference = max_weight_difference(checkpoint_weights(group / final), checkpoint_weights(single / final))
        assert difference <= WEIGHT_ATOL


@contextlib.contextmanager
def named_hosts(hosts: list[Host]):
    """Each namespace's own /etc/hosts (``ip netns exec`` mounts /etc/netns/NAME/hosts over it) naming every
    host by its namespace's name: torchft advertises its servers by host name."""
    lines = ["127.0.0.1 localhost", *(f"{host.address} {host.namespace}" for host in hosts)]
    for host in hosts:
        directory = Path("/etc/netns") / host.namespace
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "hosts").write_text("\n".join(lines) + "\n")
    try:
        yield
    finally:
        for host in hosts:
            shutil.rmtree(Path("/etc/netns") / host.namespace, ignore_errors=True)


def on_host(host: Host, args: list[str], directory: Path, fault: str | None = None) -> tuple[subprocess.Popen, Path]:
    """``paratrain ARGS`` inside ``host``'s namespace under its own host name (a UTS namespace), its output to a
    file (an unread pipe would fill and stall it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": host.interface}
    if fault:
        env["PARATRAIN_FAULT"] = fault
    log = directory / f"{host.namespace}-{args[0]}-{len(list(directory.glob('*.log')))}.log"
    named = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host.namespace]
    argv = ["ip", "netns", "exec", host.namespace, *named, sys.executable, "-m", "paratrain.cli", *args]
    with log.open("w") as stream:
        process = subprocess.Popen(argv, stdout=stream, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    return process, log


def wait_for(process: subprocess.Popen, log: Path) -> str:
    code = process.wait(timeout=400)
    assert code == 0, f"{log.name} failed ({code}):\n{log.read_text()[-4000:]}"
    return log.read_text()
