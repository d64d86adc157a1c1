"""Slurm: the launch options of a ``paratrain train`` inside an srun step, and the sbatch script
``paratrain slurm`` writes.

Inside ``srun`` every node runs the same command; Slurm's environment says how many nodes there are
(``SLURM_NNODES``), which one this is (``SLURM_NODEID``) and their names (``SLURM_JOB_NODELIST``, in
Slurm's compressed form: the first name, node 0, hosts the rendezvous).
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from paratrain.errors import ConfigError
from paratrain.launch.launcher import LaunchOptions

# srun sets SLURM_STEP_ID in a job step only; the batch script itself runs outside any step and must
# not mistake itself for node 0 of an N-node launch.
STEP_VARIABLE = "SLURM_STEP_ID"
RENDEZVOUS_PORT_BASE = 29500
GROUP_PORT_STRIDE = 1009  # replica group I of a job rendezvous I x 1009 ports further (a prime: few clashes)

# sbatch --time's formats (man sbatch): minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds; INFINITE and UNLIMITED mean no limit.
SBATCH_TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|INFINITE|UNLIMITED", re.IGNORECASE)


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands Slurm's compressed host list as ``scontrol show hostnames`` does:
    ``node[01-03,07]`` -> node01 node02 node03 node07, ``a1,b[2-3]`` -> a1 b2 b3 (zero padding kept).

    Raises:
        ConfigError: on a malformed list (unbalanced brackets, a reversed range).
    """
    hosts: list[str] = []
    for item in _split_top_level(hostlist):
        hosts += _expand_item(item, hostlist)
    return hosts


def _split_top_level(hostlist: str) -> list[str]:
    # Commas inside brackets separate ranges of one name, outside them separate names.
    items, depth, current = [], 0, ""
    for char in hostlist.strip():
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ConfigError(f"SLURM_JOB_NODELIST={hostlist!r}: unbalanced brackets")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise ConfigError(f"SLURM_JOB_NODELIST={hostlist!r}: unbalanced brackets")
    return [item for item in [*items, current] if item]


def _expand_item(item: str, hostlist: str) -> list[str]:
    match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", item)
    if not match:
        if "[" in item or "]" in item:
            raise ConfigError(f"SLURM_JOB_NODELIST={hostlist!r}: cannot read {item!r}")
        return [item]
    prefix, ranges, suffix = match.groups()
    hosts = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        high = high or low
        if not (low.isdigit() and high.isdigit()) or int(high) < int(low):
            raise ConfigError(f"SLURM_JOB_NODELIST={hostlist!r}: {part!r} is not a range like 01-04")
        hosts += [f"{prefix}{number:0{len(low)}d}{suffix}" for number in range(int(low), int(high) + 1)]
    return hosts


def in_srun_step(env: Mapping[str, str]) -> bool:
    return STEP_VARIABLE in env and "SLURM_NNODES" in env and "SLURM_NODEID" in env


def apply_slurm_environment(
    options: LaunchOptions, env: Mapping[str, str], *, nnodes_given: bool, replica_group: int | None = None
) -> LaunchOptions:
    """The launch options with nodes, node rank and rendezvous endpoint taken from Slurm's environment
    inside an srun step (unchanged outside one).

    The step's own nodes count (``SLURM_STEP_NODELIST``, ``SLURM_STEP_NUM_NODES`` where srun sets them): a
    replica group's step (``paratrain slurm --replica-groups``) runs on some of the job's nodes, and its
    node 0 is the first of those. Each group rendezvous on a port of its own (``replica_group``), so that two
    groups whose first node is the same never meet in one rendezvous.

    Raises:
        ConfigError: when --nnodes or --node-rank contradict Slurm's, or the node list does not match
            the node count.
    """
    if not in_srun_step(env):
        return options
    count_key = "SLURM_STEP_NUM_NODES" if "SLURM_STEP_NUM_NODES" in env else "SLURM_NNODES"
    list_key = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in env else "SLURM_JOB_NODELIST"
    nnodes = int(env[count_key])
    hosts = expand_hostlist(env.get(list_key, env.get("SLURMD_NODENAME", "localhost")))
    if nnodes_given and options.nnodes != nnodes:
        raise ConfigError(
            f"--nnodes {options.nnodes} contradicts {count_key}={nnodes} of this srun step: drop --nnodes "
            f"(paratrain takes it from Slurm) or request {options.nnodes} nodes from Slurm"
        )
    if len(hosts) < nnodes:
        raise ConfigError(f"{list_key}={env.get(list_key)!r} names {len(hosts)} hosts but {count_key}={nnodes}")
    # This node's place among the step's nodes, by name where srun says both; SLURM_NODEID otherwise.
    name = env.get("SLURMD_NODENAME")
    node_rank = hosts.index(name) if list_key == "SLURM_STEP_NODELIST" and name in hosts else int(env["SLURM_NODEID"])
    # One port per job (and per replica group), so two jobs sharing node 0 do not meet in one rendezvous.
    job_and_group = int(env.get("SLURM_JOB_ID", "0")) + GROUP_PORT_STRIDE * (replica_group or 0)
    endpoint = options.rdzv_endpoint or f"{hosts[0]}:{RENDEZVOUS_PORT_BASE + job_and_group % 10000}"
    return replace(options, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=endpoint)


@dataclass(frozen=True)
class SlurmJob:
    """What ``paratrain slurm`` asks Slurm for.

    Attributes:
        nodes: Nodes, one paratrain launcher on each.
        gpus_per_node: GPUs per node, one training process each (with device="cpu": processes per node,
            a CPU each).
        device: "cuda" requests GPUs from Slurm; "cpu" requests CPUs (clusters without GRES, tests).
        replica_groups: Fault-tolerant replica groups sharing the job's nodes out (1: a plain job); see
            ``launch/slurm_groups.py``.
        max_restarts: Restarts of each launcher's workers (torchrun's --max-restarts); None: none asked.
    """

    config: Path
    overrides: tuple[str, ...]
    nodes: int
    gpus_per_node: int
    job_name: str
    output_dir: Path
    time: str | None = None
    partition: str | None = None
    device: str = "cuda"
    replica_groups: int = 1
    max_restarts: int | None = None

    def validate(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ConfigError(
                f"--nodes {self.nodes} --gpus-per-node {self.gpus_per_node}: both must be >= 1 "
                f"(with --device cpu, --gpus-per-node is processes per node)"
            )
        if self.max_restarts is not None and self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts} must be >= 0 (0: a failed worker ends its launcher)")
        if self.time is not None and not SBATCH_TIME.fullmatch(self.time):
            raise ConfigError(
                f"--time {self.time!r} is not a time limit sbatch accepts: give minutes, MM:SS, HH:MM:SS, D-HH, "
                f"D-HH:MM or D-HH:MM:SS (e.g. --time 24:00:00 or --time 2-00:00:00), or UNLIMITED"
            )


def sbatch_header(job: SlurmJob, tasks: list[str], *, workdir: Path) -> list[str]:
    """The ``#SBATCH`` lines of a paratrain job, plain or of replica groups (``tasks``: its tasks and
    resources per node): USR1 two minutes before the time limit, requeue, one appended log."""
    options = [f"#SBATCH --time={job.time}"] * bool(job.time) + [f"#SBATCH --partition={job.partition}"] * bool(
        job.partition
    )
    return [
        "#!/bin/bash",
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --nodes={job.nodes}",
        *tasks,
        *options,
        "#SBATCH --signal=B:USR1@120",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --chdir={workdir}",
        f"#SBATCH --output={job.output_dir}/slurm-%j.out",
        "",
    ]


def render_sbatch(job: SlurmJob, *, workdir: Path, python: str = sys.executable) -> str:
    """The sbatch script: one launcher per node through srun; Slurm sends the batch shell USR1 two
    minutes before the time limit (or on ``scancel --signal=USR1 --batch``), the shell passes it to the
    launchers, which stop at an agreed step, save and exit 75, and the shell requeues the job."""
    resources = [f"#SBATCH --gpus-per-node={job.gpus_per_node}"] * (job.device == "cuda")
    train = [python, "-m", "paratrain.cli", "train", str(job.config), *job.overrides]
    train += ["--nproc-per-node", str(job.gpus_per_node), "checkpoint.resume=auto"]
    train += ["--max-restarts", str(job.max_restarts)] * (job.max_restarts is not None)
    lines = [
        *sbatch_header(
            job,
            ["#SBATCH --ntasks-per-node=1", *resources, f"#SBATCH --cpus-per-task={job.gpus_per_node}"],
            workdir=workdir,
        ),
        "# The launchers on every node; each reads its node rank and node 0's address from Slurm.",
        f"srun --kill-on-bad-exit=1 {shlex.join(train)} &",
        "launchers=$!",
        "# USR1 (time limit near, or preemption) reaches this shell only (B:); pass it on to the launchers.",
        "trap 'kill -USR1 $launchers' USR1",
        "wait $launchers",
        "code=$?",
        "while kill -0 $launchers 2>/dev/null; do wait $launchers; code=$?; done  # wait ends early on a trap",
        "if [ $code -eq 75 ]; then",
        '  echo "paratrain: stopped for a requeue (exit 75): requeueing job $SLURM_JOB_ID"',
        "  scontrol requeue $SLURM_JOB_ID",
        "fi",
        "exit $code",
        "",
    ]
    return "\n".join(lines)
