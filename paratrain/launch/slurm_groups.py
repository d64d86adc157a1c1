"""The sbatch script of fault-tolerant replica groups (``paratrain slurm --replica-groups N``): one job whose
nodes are shared out among the groups, a job step for the lighthouse on its first node, one job step per
group, and the requeue of a plain job (``launch/slurm.py``).

A group is one ``paratrain train --replica-group I`` per node of its own, as a plain job's launchers are;
its torchrun restarts its workers (``--max-restarts``) while the other groups step on. USR1 (the time limit
near, or ``scancel --signal=USR1 --batch``) goes to every group's launchers; each group stops at a step its
ranks agree on, saves and exits 75, and the script requeues the job when a group asked for it. The requeued
job starts a new lighthouse (on a port free then, as every lighthouse of these scripts); each group resumes
from its newest checkpoint and a group behind heals from the newest.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from paratrain.errors import ConfigError
from paratrain.launch.slurm import SlurmJob, sbatch_header

DEFAULT_GROUP_RESTARTS = 3
LIGHTHOUSE_START_S = 120  # how long the script waits for the lighthouse to answer before starting groups


@dataclass(frozen=True)
class GroupPlacement:
    """Where the replica groups of a job run.

    Attributes:
        nodes: Nodes of each group (one launcher on each).
        processes: Processes of a group on each of its nodes.
        per_node: Groups sharing one node (1: each group has nodes of its own).
    """

    nodes: int
    processes: int
    per_node: int

    def first_node(self, group: int) -> int:
        """The index, among the job's nodes, of ``group``'s first node (srun --relative)."""
        return group * self.nodes if self.per_node == 1 else group // self.per_node


def place_groups(*, nodes: int, gpus_per_node: int, replica_groups: int) -> GroupPlacement:
    """Whole nodes per group where the groups divide the nodes, else an equal share of one node each.

    Raises:
        ConfigError: naming the flags, for one group or a split that leaves groups unequal.
    """
    if replica_groups < 2:
        raise ConfigError(
            f"--replica-groups {replica_groups}: fault tolerance needs at least 2 groups (one has no live peer to "
            f"heal from); drop --replica-groups for a plain job"
        )
    if nodes % replica_groups == 0:
        return GroupPlacement(nodes // replica_groups, gpus_per_node, 1)
    per_node = replica_groups // nodes
    if replica_groups % nodes == 0 and gpus_per_node % per_node == 0:
        return GroupPlacement(1, gpus_per_node // per_node, per_node)
    raise ConfigError(
        f"--replica-groups {replica_groups} cannot share --nodes {nodes} x --gpus-per-node {gpus_per_node} out "
        f"equally: give each group whole nodes (--nodes a multiple of --replica-groups) or an equal part of one "
        f"node (--replica-groups a multiple of --nodes whose groups per node divide --gpus-per-node)"
    )


def render_group_sbatch(job: SlurmJob, *, workdir: Path, python: str = sys.executable) -> str:
    """The sbatch script of ``job.replica_groups`` groups (see the module docstring)."""
    place = place_groups(nodes=job.nodes, gpus_per_node=job.gpus_per_node, replica_groups=job.replica_groups)
    restarts = DEFAULT_GROUP_RESTARTS if job.max_restarts is None else job.max_restarts
    lines = [*_header(job, place, workdir=workdir), *_lighthouse_step(python, job.output_dir), "groups=()"]
    for group in range(job.replica_groups):
        lines += [
            f"{shlex.join(_group_step(job, place, group=group))} {_group_train(job, place, group, restarts, python)} &",
            "groups+=($!)",
        ]
    return "\n".join([*lines, *_wait_and_requeue()]) + "\n"


def _header(job: SlurmJob, place: GroupPlacement, *, workdir: Path) -> list[str]:
    resources = [f"#SBATCH --gpus-per-node={job.gpus_per_node}"] * (job.device == "cuda")
    tasks = [f"#SBATCH --ntasks-per-node={place.per_node}", f"#SBATCH --cpus-per-task={place.processes}"]
    return sbatch_header(job, [*tasks, *resources], workdir=workdir)


def _lighthouse_step(python: str, output_dir: Path) -> list[str]:
    lighthouse = shlex.join([python, "-m", "paratrain.cli", "lighthouse"])
    address_file = shlex.quote(str(output_dir)) + '/"lighthouse-$SLURM_JOB_ID.address"'
    return [
        "# The lighthouse on the job's first node; --overlap: it shares that node's CPUs with the groups there.",
        "# It binds a port the node has free (a fixed one may be taken) and writes its address for this script.",
        'lighthouse_host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"address_file={address_file}",
        'rm -f "$address_file"  # a requeued job keeps its id: never read the previous run\'s address',
        f'srun --nodes=1 --ntasks=1 --overlap --nodelist="$lighthouse_host" {lighthouse} '
        '--bind "$lighthouse_host:0" --address-file "$address_file" &',
        "lighthouse=$!",
        "# Groups give up on a lighthouse that does not answer within connect_timeout_s: wait for it here first.",
        f"for attempt in $(seq {LIGHTHOUSE_START_S}); do",
        '  [ -s "$address_file" ] && break',
        "  sleep 1",
        "done",
        'lighthouse_address=$(cat "$address_file")',
        "lighthouse_port=${lighthouse_address##*:}",
        "",
    ]


def _group_step(job: SlurmJob, place: GroupPlacement, *, group: int) -> list[str]:
    """srun of one group: a launcher on each of its nodes, with only the CPUs (and GPUs) it asked for."""
    gpus = [f"--gpus-per-node={place.processes}"] * (job.device == "cuda")
    return [
        "srun",
        f"--nodes={place.nodes}",
        f"--ntasks={place.nodes}",
        "--ntasks-per-node=1",
        f"--relative={place.first_node(group)}",
        f"--cpus-per-task={place.processes}",
        *gpus,
        "--exact",
        "--kill-on-bad-exit=1",
    ]


def _group_train(job: SlurmJob, place: GroupPlacement, group: int, restarts: int, python: str) -> str:
    train = [python, "-m", "paratrain.cli", "train", str(job.config), *job.overrides]
    train += ["--nproc-per-node", str(place.processes), "--replica-group", str(group)]
    train += ["--replica-groups", str(job.replica_groups), "--max-restarts", str(restarts), "checkpoint.resume=auto"]
    # The address is the shell's, known once the job runs: left unquoted by shlex, quoted here.
    return shlex.join(train) + ' "parallel.fault_tolerance.lighthouse=http://$lighthouse_host:$lighthouse_port"'


def _wait_and_requeue() -> list[str]:
    return [
        "",
        "# USR1 (time limit near, or preemption) reaches this shell only (B:); pass it on to every group.",
        "trap 'kill -USR1 \"${groups[@]}\"' USR1",
        "codes=()",
        'for group in "${groups[@]}"; do',
        "  wait $group",
        "  code=$?",
        "  while kill -0 $group 2>/dev/null; do wait $group; code=$?; done  # wait ends early on a trap",
        "  codes+=($code)",
        "done",
        "kill $lighthouse 2>/dev/null",
        "wait $lighthouse 2>/dev/null",
        'echo "paratrain: replica groups exited with codes ${codes[*]}"',
        "code=0",
        'for one in "${codes[@]}"; do',
        "  if [ $one -eq 75 ]; then code=75; elif [ $one -ne 0 ] && [ $code -eq 0 ]; then code=$one; fi",
        "done",
        "if [ $code -eq 75 ]; then",
        '  echo "paratrain: a group stopped for a requeue (exit 75): requeueing job $SLURM_JOB_ID"',
        "  scontrol requeue $SLURM_JOB_ID",
        "fi",
        "exit $code",
    ]
