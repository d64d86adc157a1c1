"""Slurm: node lists expanded as ``scontrol show hostnames`` does, launch options taken from an srun
step's environment, and the sbatch script ``paratrain slurm`` writes (the real cluster: tests/slurm/)."""

from __future__ import annotations

import pytest

from paratrain.errors import EXIT_USER_ERROR, ConfigError
from paratrain.launch.launcher import LaunchOptions
from paratrain.launch.slurm import apply_slurm_environment, expand_hostlist
from paratrain.launch.slurm_groups import place_groups
from tests.harness import run_cli_in_process, tiny_config, write_config


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-04]", ["node01", "node02", "node03", "node04"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node[8-11]", ["node8", "node9", "node10", "node11"]),
        ("node[098-101]", ["node098", "node099", "node100", "node101"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("gpu[01-02,07],cpu5", ["gpu01", "gpu02", "gpu07", "cpu5"]),
        ("rack[1-2]-n", ["rack1-n", "rack2-n"]),
        ("x-[3]", ["x-3"]),
    ],
)
def test_node_list_expands_like_scontrol_show_hostnames(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist", ["node[01-04", "node01]", "node[04-01]", "node[a-b]"])
def test_malformed_node_list_is_refused_naming_it(hostlist):
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        expand_hostlist(hostlist)


def srun_env(nodes: str, nnodes: int, node_id: int) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "1234",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": nodes,
        "SLURM_NNODES": str(nnodes),
        "SLURM_NODEID": str(node_id),
    }


@pytest.mark.parametrize(
    ("env", "nnodes", "node_rank", "endpoint"),
    [
        (srun_env("node[01-04]", 4, 0), 4, 0, "node01:30734"),
        (srun_env("node[01-04]", 4, 3), 4, 3, "node01:30734"),
        (srun_env("a1,b[2-3]", 3, 2), 3, 2, "a1:30734"),
        (srun_env("solo", 1, 0), 1, 0, "solo:30734"),
        # The batch script itself (no step): the options stay as given.
        ({**srun_env("node[01-04]", 4, 0), "SLURM_STEP_ID": None}, 1, 0, None),
    ],
)
def test_launch_options_come_from_the_srun_step(env, nnodes, node_rank, endpoint):
    env = {key: value for key, value in env.items() if value is not None}
    options = apply_slurm_environment(LaunchOptions(nproc_per_node=2), env, nnodes_given=False)
    assert (options.nnodes, options.node_rank, options.rdzv_endpoint) == (nnodes, node_rank, endpoint)
    assert options.nproc_per_node == 2
    options.validate()


def test_nnodes_contradicting_slurm_is_refused():
    with pytest.raises(ConfigError, match="--nnodes 2 contradicts SLURM_NNODES=4"):
        apply_slurm_environment(LaunchOptions(nnodes=2), srun_env("node[01-04]", 4, 1), nnodes_given=True)
    with pytest.raises(ConfigError, match="names 2 hosts but SLURM_NNODES=4"):
        apply_slurm_environment(LaunchOptions(), srun_env("node[01-02]", 4, 1), nnodes_given=False)


def test_train_inside_srun_with_contradicting_nnodes_exits_2(tmp_path, monkeypatch):
    for key, value in srun_env("node[01-04]", 4, 1).items():
        monkeypatch.setenv(key, value)
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run"))
    code, stderr = run_cli_in_process(["train", str(config), "--nnodes", "2"])
    assert code == EXIT_USER_ERROR and "SLURM_NNODES=4" in stderr


def test_slurm_writes_one_launcher_per_node_with_usr1_and_requeue(tmp_path):
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run"))
    script = tmp_path / "job.sbatch"
    args = ["slurm", str(config), "train.max_steps=7", "--nodes", "4", "--gpus-per-node", "8", "--time", "1:00:00"]
    code, stderr = run_cli_in_process([*args, "--partition", "gpu", "--out", str(script)])
    assert code == 0, stderr
    text = script.read_text()
    for line in [
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=1:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --signal=B:USR1@120",
        "#SBATCH --requeue",
        "trap 'kill -USR1 $launchers' USR1",
        "if [ $code -eq 75 ]; then",
        "  scontrol requeue $SLURM_JOB_ID",
    ]:
        assert line in text.splitlines(), line
    (srun,) = [line for line in text.splitlines() if line.startswith("srun ")]
    assert f"train {config} train.max_steps=7 --nproc-per-node 8 checkpoint.resume=auto" in srun
    assert "--nnodes" not in srun  # taken from Slurm on every node


def test_a_replica_group_step_rendezvous_on_its_own_nodes_and_port():
    # Group 1 of a 4-node job runs on node03 and node04; this is node04. SLURM_NODEID says nothing here.
    env = {
        **srun_env("node[01-04]", 4, 3),
        "SLURM_STEP_NODELIST": "node[03-04]",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURMD_NODENAME": "node04",
    }
    options = apply_slurm_environment(LaunchOptions(nproc_per_node=8), env, nnodes_given=False, replica_group=1)
    assert (options.nnodes, options.node_rank, options.rdzv_endpoint) == (2, 1, f"node03:{29500 + 1234 + 1009}")
    group_0 = apply_slurm_environment(LaunchOptions(nproc_per_node=8), env, nnodes_given=False, replica_group=0)
    assert group_0.rdzv_endpoint != options.rdzv_endpoint  # two groups on one first node never share a rendezvous


@pytest.mark.parametrize(
    ("nodes", "gpus", "groups", "placement"),
    [(4, 8, 2, (2, 8, 1)), (4, 8, 4, (1, 8, 1)), (1, 2, 2, (1, 1, 2)), (2, 8, 4, (1, 4, 2))],
)
def test_replica_groups_get_whole_nodes_or_an_equal_share_of_one(nodes, gpus, groups, placement):
    place = place_groups(nodes=nodes, gpus_per_node=gpus, replica_groups=groups)
    assert (place.nodes, place.processes, place.per_node) == placement
    # Every group starts on a node of the job, and the groups on a node fill it exactly.
    firsts = [place.first_node(group) for group in range(groups)]
    assert max(firsts) + place.nodes <= nodes
    assert all(firsts.count(first) * place.processes <= gpus for first in firsts)


def test_slurm_with_replica_groups_writes_a_lighthouse_step_and_one_step_per_group_with_requeue(tmp_path):
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run"))
    script = tmp_path / "job.sbatch"
    args = ["slurm", str(config), "--nodes", "4", "--gpus-per-node", "8", "--replica-groups", "2", "--out", str(script)]
    code, stderr = run_cli_in_process(args)
    assert code == 0, stderr
    lines = script.read_text().splitlines()
    for line in [
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@120",
    ]:
        assert line in lines, line
    (lighthouse,) = [line for line in lines if line.startswith("srun") and " lighthouse " in line]
    assert "--overlap" in lighthouse and '--bind "$lighthouse_host:0" --address-file "$address_file"' in lighthouse
    groups = [line for line in lines if line.startswith("srun") and " train " in line]
    assert len(groups) == 2
    for group, line in enumerate(groups):
        assert f"--nodes=2 --ntasks=2 --ntasks-per-node=1 --relative={2 * group}" in line
        assert f"--nproc-per-node 8 --replica-group {group} --replica-groups 2 --max-restarts 3" in line
        assert line.endswith('"parallel.fault_tolerance.lighthouse=http://$lighthouse_host:$lighthouse_port" &')
    assert "trap 'kill -USR1 \"${groups[@]}\"' USR1" in lines and "  scontrol requeue $SLURM_JOB_ID" in lines
