"""Fault-tolerant replica groups on torchft, through the real CLI: a loopback lighthouse (`paratrain
lighthouse`), each group its own `paratrain train --replica-group I --replica-groups N` (its own torchrun).

Without a failure, two groups of one process train exactly as DDP over two processes. With one (a group's
worker SIGKILLed, torchrun restarting it), the other group keeps stepping, the restarted group heals from it
(no checkpoint read) and both end with the same weights. Under `batch: fixed` (the default) the live groups
also compute the missing groups' slices, so a run of three groups that loses one, then two at once, logs the
losses and ends with the weights of one process training the same global batch undisturbed.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from paratrain.errors import EXIT_REQUEUE
from tests.harness import (
    checkpoint_weights,
    free_loopback_port,
    losses_by_step,
    max_relative_difference,
    max_weight_difference,
    read_metrics,
    restartable_loopback_port,
    start_cli,
    tiny_config,
    train,
    write_config,
)

pytest.importorskip("torchft", reason="replica groups need the ft extra: pip install 'paratrain[ft]'")
# Each test's own waits are bounded (the groups' quorum timeout, 400 s per group's exit), and several groups
# restarting on a loaded 2-core machine take minutes: the suite's 300 s default would cut them short.
pytestmark = pytest.mark.timeout(900)

STEPS = 20


# A loaded machine can starve a group for long stretches: the lighthouse waits for a live group's quorum
# request for up to JOIN_TIMEOUT_S (a dead one is left out after HEARTBEAT_TIMEOUT_S without heartbeats), and
# every group waits for the quorum longer than that, so no test passes or fails by the machine's speed.
JOIN_TIMEOUT_S = 300
QUORUM_TIMEOUT_S = JOIN_TIMEOUT_S + 60
# A group starved of the CPU stops heartbeating too, and past the heartbeat timeout it is left out as a dead
# one would be: its peer steps alone and it heals over that step, logging none (seen in a CI run with a 1 s
# timeout: step 14 took 2 s in both groups, group 0 took step 15 alone). Right, but not what these tests
# assert of a live group, so tests without a death use a lighthouse that never takes a live group for dead in
# a test's time. Tests in which a group dies need the death seen well before torchrun's restart of the group is
# back (a few seconds: at 3 s a restarted group was back before its peer had stepped alone, which the shrink
# test checks), so they keep 1 s.
HEARTBEAT_TIMEOUT_S = 1.0
STEADY_HEARTBEAT_TIMEOUT_S = 60.0
# Likewise a rank starved for rendezvous_timeout_s (2 s) as its quorum connects makes the groups retake that step
# (right, and harmless), which the tests counting retaken steps do not expect: they give it as long as a join.
STEADY_RENDEZVOUS_TIMEOUT_S = JOIN_TIMEOUT_S


def start_lighthouse(port: int, log: Path, *, heartbeat_timeout_s: float) -> subprocess.Popen:
    """A lighthouse on loopback ``port``, once it says it serves there (an answer on the port could be another
    process's). It forgets a group silent for ``heartbeat_timeout_s``. A port just freed by a killed lighthouse
    may still be taken for a moment: the start is tried again, for up to 60 s."""
    deadline = time.monotonic() + 60
    command = [
        "lighthouse", "--bind", f"127.0.0.1:{port}", "--heartbeat-timeout-ms", str(int(heartbeat_timeout_s * 1000)),
        "--join-timeout-ms", str(JOIN_TIMEOUT_S * 1000),
    ]  # fmt: skip
    server = start_cli(command, output=log)
    while "lighthouse serving at" not in log.read_text() or server.poll() is not None:
        assert time.monotonic() < deadline, f"the lighthouse did not start:\n{log.read_text()[-2000:]}"
        if server.poll() is not None:
            server = start_cli(command, output=log)
        time.sleep(0.1)
    return server


def serve_lighthouse(tmp_path: Path, *, heartbeat_timeout_s: float):
    port = free_loopback_port()
    server = start_lighthouse(port, tmp_path / "lighthouse.log", heartbeat_timeout_s=heartbeat_timeout_s)
    yield f"http://127.0.0.1:{port}"
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture
def lighthouse(tmp_path):
    """A lighthouse on a free loopback port that takes a group silent for HEARTBEAT_TIMEOUT_S for dead: its address."""
    yield from serve_lighthouse(tmp_path, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)


@pytest.fixture
def steady_lighthouse(tmp_path):
    """A lighthouse for tests in which no group dies: a starved group is never left out."""
    yield from serve_lighthouse(tmp_path, heartbeat_timeout_s=STEADY_HEARTBEAT_TIMEOUT_S)


@dataclass
class Group:
    """One group's `paratrain train`, its output going to a file (an unread pipe would fill and stall it)."""

    process: subprocess.Popen
    log: Path


def start_group(
    config: Path, group: int, *, groups: int = 2, extra: list[str] = (), env: dict[str, str] | None = None
) -> Group:
    log = config.parent / f"group-{group}-{time.monotonic_ns()}.log"  # a group started again logs anew
    args = ["train", str(config), "--replica-group", str(group), "--replica-groups", str(groups), *extra]
    return Group(start_cli(args, env=env, output=log), log)


def reaches_its_kill_point(step: int) -> str:
    """A live group's fault that waits at steps 2 to ``step`` until every group is in the quorum, so that a group
    set to die after ``step`` takes it. On a loaded machine the lighthouse can leave a group starved for
    HEARTBEAT_TIMEOUT_S out after the start-up quorum: the others then stepped past its kill point alone, and
    it healed later and was never killed (seen once: healed at step 6, set to die after step 3)."""
    return f"wait_for_groups:2-{step}"


def together(first: int, last: int) -> str:
    """A fault that keeps a group from stepping without every other at steps ``first`` to ``last`` (in any
    attempt; set it only where every group is alive then): it asks for the quorum again until every group is in
    it. Otherwise a live peer starved past the lighthouse's 1 s heartbeat timeout is left out, and heals over
    the step this group takes alone: right, but not what a test that follows one group's every step asserts."""
    return f"wait_for_groups:{first}-{last}"


def start_groups(
    config: Path,
    *,
    groups: int = 2,
    extra: dict[int, list[str]] | None = None,
    env: dict[int, dict[str, str]] | None = None,
) -> list[Group]:
    extra, env = extra or {}, env or {}
    return [
        start_group(config, group, groups=groups, extra=extra.get(group, []), env=env.get(group))
        for group in range(groups)
    ]


def finish(groups: list[Group]) -> list[str]:
    """Each group's output, once every group exited 0."""
    for index, group in enumerate(groups):
        code = group.process.wait(timeout=400)
        assert code == 0, f"group {index} failed ({code}):\n{group.log.read_text()[-4000:]}"
    return [group.log.read_text() for group in groups]


def test_two_replica_groups_without_failure_train_exactly_as_ddp_over_two_processes(tmp_path, steady_lighthouse):
    parallel = {"fault_tolerance": {"lighthouse": steady_lighthouse, "quorum_timeout_s": QUORUM_TIMEOUT_S}}
    sections = {"parallel": parallel, "train": {"max_steps": STEPS}, "checkpoint": {"every_steps": STEPS // 2}}
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "ft", **sections))
    groups = start_groups(config)
    ddp = tmp_path / "ddp"
    train(config, f"run.output_dir={ddp}", "parallel.strategy=ddp", nproc=2)  # while the groups train
    finish(groups)
    for group in (tmp_path / "ft/replica-group-0", tmp_path / "ft/replica-group-1"):
        losses = losses_by_step(group)
        assert sorted(losses) == list(range(1, STEPS + 1))
        assert max_relative_difference(losses, losses_by_step(ddp)) <= 1e-5
        records = read_metrics(group)
        assert {(r["replica_groups_live"], r["effective_batch"], r["skipped_samples"]) for r in records} == {(2, 8, 0)}
        weights = checkpoint_weights(group / f"checkpoints/step-{STEPS}")
        assert max_weight_difference(weights, checkpoint_weights(ddp / f"checkpoints/step-{STEPS}")) <= 1e-5
    # A group's checkpoint resumes into a plain layout like any other: one process continues as DDP did.
    plain, halfway = tmp_path / "plain", tmp_path / f"ft/replica-group-1/checkpoints/step-{STEPS // 2}"
    train(config, f"run.output_dir={plain}", f"checkpoint.resume={halfway}")
    second_half = {step: loss for step, loss in losses_by_step(ddp).items() if step > STEPS // 2}
    assert max_relative_difference(losses_by_step(plain), second_half) <= 1e-5


def test_under_shrink_a_killed_group_heals_from_its_live_peer_while_the_peer_keeps_stepping(tmp_path, lighthouse):
    steps, killed_after, back_by = 40, 5, 30
    # batch: shrink, the live group trains on its own slice alone while its peer is away.
    ft = {"lighthouse": lighthouse, "quorum_timeout_s": QUORUM_TIMEOUT_S, "batch": "shrink"}
    ft["rendezvous_timeout_s"] = STEADY_RENDEZVOUS_TIMEOUT_S
    parallel = {"fault_tolerance": ft}
    config = write_config(
        tmp_path / "c.yaml", tiny_config(tmp_path / "ft", parallel=parallel, train={"max_steps": steps})
    )
    # Group 0 takes half a second a step while group 1 is away, and at step 30 waits for it to be back: however
    # slow torchrun's restart of group 1 is on this machine, group 1 heals from a group still training.
    # It also waits for group 1 up to the step group 1 dies after (see reaches_its_kill_point).
    slow_alone = (
        f"{reaches_its_kill_point(killed_after)},slow_step:{killed_after + 1}-{steps},{together(back_by, steps)}"
    )
    # Group 1 never steps without group 0, which is alive throughout: the healthy group takes every step.
    # Its restart comes back LATE_MANAGER_S late: a fast restart (workers forked, nothing imported again)
    # would otherwise rejoin before the lighthouse left it out, and group 0 would never step alone.
    dies = f"{together(2, steps)},after_step:{killed_after},late_manager_on_restart:0"
    groups = start_groups(
        config,
        extra={1: ["--max-restarts", "1"]},
        env={0: {"PARATRAIN_FAULT": slow_alone}, 1: {"PARATRAIN_FAULT": dies}},
    )
    healthy_log, healed_log = finish(groups)
    healthy, healed = tmp_path / "ft/replica-group-0", tmp_path / "ft/replica-group-1"
    assert "healed from a live replica group" in healed_log and "resumed from" not in healed_log
    # The healed group took its first step in the quorum that healed it: group 0 never waited for it.
    assert "not committed" not in healthy_log
    records = read_metrics(healthy)
    # The healthy group took every step once, none again: some alone while group 1 was away.
    assert [record["step"] for record in records] == list(range(1, steps + 1))
    alone = [record for record in records if record["replica_groups_live"] == 1]
    assert alone and all(record["effective_batch"] == 4 for record in alone)
    assert records[-1]["skipped_samples"] == 4 * len(alone)  # half of each lone step's batch of 8
    # The healed group reports the run's count, received with the state.
    assert read_metrics(healed)[-1]["skipped_samples"] == records[-1]["skipped_samples"]
    final = f"checkpoints/step-{steps}"
    assert max_weight_difference(checkpoint_weights(healthy / final), checkpoint_weights(healed / final)) == 0.0


def test_under_a_fixed_batch_losing_one_group_then_two_at_once_trains_exactly_as_an_undisturbed_run(
    tmp_path, lighthouse
):
    """Three groups of one process. Group 2 dies after step 5 and is started again (as a scheduler would);
    groups 0 and 1 both die after step 18 and torchrun restarts them. The run is still one over the whole
    global batch of 12 at every step: compared with one process training it undisturbed."""
    steps, first_kill, double_kill = 30, 5, 18
    ft = {"lighthouse": lighthouse, "quorum_timeout_s": QUORUM_TIMEOUT_S}
    train_section = {"max_steps": steps, "global_batch_size": 12, "micro_batch_size": 2}
    config = write_config(
        tmp_path / "c.yaml", tiny_config(tmp_path / "ft", parallel={"fault_tolerance": ft}, train=train_section)
    )
    # Fixed points, not sleeps: groups 0 and 1 take half a second a step while group 2 is away and wait at
    # step 12 until it is back; group 2, started again, does the same while 0 and 1 are away, waiting at 26.
    # Their restarts come back LATE_MANAGER_S late, so that group 2 steps alone whatever a restart takes.
    survivors = (
        f"{reaches_its_kill_point(first_kill)},slow_step:{first_kill + 1}-12,wait_for_groups:12,"
        f"after_step:{double_kill},late_manager_on_restart:0"
    )
    groups = start_groups(
        config,
        groups=3,
        extra={0: ["--max-restarts", "1"], 1: ["--max-restarts", "1"]},
        env={
            0: {"PARATRAIN_FAULT": survivors},
            1: {"PARATRAIN_FAULT": survivors},
            2: {"PARATRAIN_FAULT": f"after_step:{first_kill}"},
        },
    )
    assert groups[2].process.wait(timeout=400) != 0, "group 2 was to be killed after step 5"
    # Back only once the two have taken a step without it: a restart can take less than their step.
    wait_for_step(tmp_path / "ft/replica-group-0", first_kill + 1, groups[:2])
    alone = f"slow_step:{double_kill + 1}-{steps},wait_for_groups:26"
    groups[2] = start_group(config, 2, groups=3, env={"PARATRAIN_FAULT": alone})
    logs = finish(groups)
    single = tmp_path / "single"
    train(config, f"run.output_dir={single}")  # the same config, undisturbed, one process
    reference = losses_by_step(single)
    dirs = [tmp_path / f"ft/replica-group-{group}" for group in range(3)]
    assert all("healed from a live replica group" in log for log in logs)
    records = [record for directory in dirs for record in read_metrics(directory)]
    # Every step was logged by some group, and each group's loss at it is the undisturbed run's.
    assert {record["step"] for record in records} == set(range(1, steps + 1))
    worst = max(abs(r["loss"] - reference[r["step"]]) / abs(reference[r["step"]]) for r in records)
    assert worst <= 1e-5
    # Nothing skipped, nothing counted twice: every step was over the whole batch of 12, some with one
    # group taking over the slice of 4 of the group away, some with one group computing all three.
    assert {(r["effective_batch"], r["skipped_samples"]) for r in records} == {(12, 0)}
    taken_over = {(r["replica_groups_live"], r["taken_over_samples"]) for r in records}
    assert {(3, 0), (2, 4), (1, 8)} <= taken_over
    # A restarted group takes part in the step of the quorum it healed in (it healed before computing anything):
    # group 2 beside the two live groups, without their taking over its slice; groups 0 and 1 beside group 2.
    first_back = [next(r for r in read_metrics(dirs[group]) if r["step"] > killed) for group, killed in
                  ((2, first_kill), (0, double_kill), (1, double_kill))]  # fmt: skip
    assert (first_back[0]["replica_groups_live"], first_back[0]["taken_over_samples"]) == (3, 0)
    assert all(record["replica_groups_live"] >= 2 for record in first_back[1:])
    final = f"checkpoints/step-{steps}"
    for directory in dirs:
        difference = max_weight_difference(checkpoint_weights(directory / final), checkpoint_weights(single / final))
        assert difference <= 1e-5


def start_two_process_groups(
    tmp_path: Path, lighthouse: str, *, steps: int, faults: dict[int, str], group_1_restarts: int = 0
) -> tuple[Path, list[Group]]:
    """Two groups of two processes (fsdp inside each) training ``steps`` steps, group g with the fault
    ``faults[g]``, group 1 restarted by torchrun up to ``group_1_restarts`` times; returns the config and groups."""
    ft = {"lighthouse": lighthouse, "quorum_timeout_s": QUORUM_TIMEOUT_S}
    ft["rendezvous_timeout_s"] = STEADY_RENDEZVOUS_TIMEOUT_S
    sections = {"parallel": {"dp_shard": 2, "fault_tolerance": ft}, "train": {"max_steps": steps}}
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "ft", **sections))
    two = ["--nproc-per-node", "2"]
    restarts = ["--max-restarts", str(group_1_restarts)] if group_1_restarts else []
    env = {group: {"PARATRAIN_FAULT": fault} for group, fault in faults.items()}
    return config, start_groups(config, extra={0: two, 1: [*two, *restarts]}, env=env)


def test_a_group_whose_ranks_heal_unalike_stops_and_its_restart_heals_every_rank(tmp_path, lighthouse):
    """Groups of two processes. Group 1's rank 0, which hosts its torchft manager, dies after step 5, and torchrun
    stops rank 1 (whose next step's collectives or quorum request fail). In torchrun's
    restart of the group, rank 1's first configure of its cross-group process group fails (as when the peer group
    it was to heal from dies in that quorum), so rank 0 heals and rank 1 does not. Each used to wait for the other
    (rank 0 inside the step, rank 1 for the next quorum) until lighthouse_wait_s; the group now stops at once, the
    next restart heals both ranks, and the run trains as one process does undisturbed."""
    steps = 30
    alone = f"{reaches_its_kill_point(5)},slow_step:6-{steps},wait_for_groups:25"
    faults = {0: alone, 1: "after_step:5:0,fail_first_configure:1:1"}
    config, groups = start_two_process_groups(tmp_path, lighthouse, steps=steps, faults=faults, group_1_restarts=2)
    _, healed_log = finish(groups)
    assert "1 of its 2 ranks received a live peer's state and the others did not" in healed_log
    assert "exitcode: 77" in healed_log  # the group's own exit, for torchrun to restart it whole
    assert "healed from a live replica group" in healed_log
    single = tmp_path / "single"
    train(config, f"run.output_dir={single}", "parallel.dp_shard=1")
    reference, final = losses_by_step(single), f"checkpoints/step-{steps}"
    for group in (
        tmp_path / "ft/replica-group-0",
        tmp_path / "ft/replica-group-1",
    ):  # group 1 logs no step it was away for
        records = read_metrics(group)
        assert max(abs(r["loss"] - reference[r["step"]]) / reference[r["step"]] for r in records) <= 1e-5
        assert max_weight_difference(checkpoint_weights(group / final), checkpoint_weights(single / final)) <= 1e-5


def assert_group_0_stepped_once_each_step_and_ends_as_group_1(tmp_path: Path, steps: int, *, pause_below: float):
    """Group 0 (alive throughout) logged each step once, never paused ``pause_below`` or longer between two steps,
    and ends with the weights of group 1 (which healed from it)."""
    healthy, healed = tmp_path / "ft/replica-group-0", tmp_path / "ft/replica-group-1"
    records = read_metrics(healthy)
    assert [record["step"] for record in records] == list(range(1, steps + 1))
    longest_pause = max(after["time"] - before["time"] for before, after in zip(records, records[1:]))
    assert longest_pause < pause_below
    final = f"checkpoints/step-{steps}"
    assert max_weight_difference(checkpoint_weights(healthy / final), checkpoint_weights(healed / final)) == 0.0


def group_1_loses_a_rank_after_step_5(tmp_path: Path, lighthouse: str, kill_point: str, steps: int) -> list[str]:
    """Groups of two processes; group 1's rank 1 dies at ``kill_point`` of step 5 and torchrun restarts the group
    once, while group 0 steps on. Neither group steps without the other where both are alive. Returns both logs."""
    alone = f"{reaches_its_kill_point(5)},slow_step:6-{steps},{together(15, steps)}"
    faults = {0: alone, 1: f"{kill_point}:5:1,{together(2, steps)}"}  # group 1 never steps without group 0
    _, groups = start_two_process_groups(tmp_path, lighthouse, steps=steps, faults=faults, group_1_restarts=1)
    return finish(groups)


def test_a_rank_that_sigterm_finds_in_a_vote_a_dead_rank_left_open_ends_at_once_and_its_group_heals(
    tmp_path, steady_lighthouse
):
    """Groups of two processes. Group 1's rank 1 dies after the all-reduce of step 5, before its commit vote, so
    group 1's rank 0 waits in torchft's vote (where no Python signal handler runs) for a vote that never comes.
    torchrun's SIGTERM finds it there, and the stuck-vote watch, which sees rank 1's process gone, ends it (exit
    77) at once instead of after timeout_s (10 s), all that time keeping the lighthouse waiting for its group.
    Group 1 heals from group 0 and both end with the same weights.

    The lighthouse takes a group for dead only after 60 s without heartbeats, yet group 0 steps on within
    seconds: the restarted group registers under the dead one's id, so the quorum need not wait for the dead
    one's heartbeats to lapse (under a fresh id per restart, group 0 paused 60 s). Group 0 committed step 5, so
    only the restarted group's announcement (a failed commit) gives that quorum a new id: without it group 0 kept
    its connections to the dead processes, failed its next step and took it again (seen), and group 1 waited
    out timeout_s."""
    steps = 20
    healthy_log, healed_log = group_1_loses_a_rank_after_step_5(tmp_path, steady_lighthouse, "before_vote", steps)
    assert "a stop signal found this rank in its group's commit vote, the group's rank in process" in healed_log
    assert "not committed" not in healthy_log
    assert "healed from a live replica group" in healed_log
    assert_group_0_stepped_once_each_step_and_ends_as_group_1(
        tmp_path, steps, pause_below=STEADY_HEARTBEAT_TIMEOUT_S / 2
    )


def test_a_rank_whose_peer_dies_between_steps_ends_at_once_and_its_group_heals(tmp_path, steady_lighthouse):
    """Groups of two processes. Group 1's rank 1 dies between steps 5 and 6, so group 1's rank 0, whose torchft
    manager server asks the lighthouse once both ranks asked it, has a quorum request that never forms (until
    quorum_timeout_s), while its heartbeats keep group 0 waiting for the group. The request is under way while rank 0
    computes its own slice, whose collectives with the dead rank fail (gloo) or, where they cannot tell (NCCL), leave
    it in the wait for the quorum, where torchrun's SIGTERM and the watch, which sees rank 1's process gone, end it
    (exit 77) at once; it used to wait for torchrun's SIGKILL 30 s later (a 30.6 s pause in the chaos benchmark).
    Group 1 heals from group 0 and both end with the same weights."""
    steps = 20
    _, healed_log = group_1_loses_a_rank_after_step_5(tmp_path, steady_lighthouse, "after_step", steps)
    assert "healed from a live replica group" in healed_log
    assert_group_0_stepped_once_each_step_and_ends_as_group_1(tmp_path, steps, pause_below=15.0)


def test_a_group_killed_right_after_joining_a_quorum_holds_the_live_group_for_the_rendezvous_not_the_timeout(
    tmp_path, steady_lighthouse
):
    """Groups of two processes. Group 1's rank 0 dies after step 5; in torchrun's restart of the group, rank 1 dies
    as soon as the quorum that takes the group back in has answered, before it connects to its peers there. Group
    0's rank 1, paired with it in that quorum's process group, gives up connecting after rendezvous_timeout_s (2 s,
    the default) instead of timeout_s (60 s here); group 0 retakes the step in the next quorum, where group 1's
    second restart heals, and both end with the same weights."""
    steps = 20
    timeout_s = 60
    ft = {"lighthouse": steady_lighthouse, "quorum_timeout_s": QUORUM_TIMEOUT_S, "timeout_s": timeout_s}
    sections = {"parallel": {"dp_shard": 2, "fault_tolerance": ft}, "train": {"max_steps": steps}}
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "ft", **sections))
    two = ["--nproc-per-node", "2"]
    alone = f"{reaches_its_kill_point(5)},slow_step:6-{steps},{together(15, steps)}"
    dies_twice = f"after_step:5:0,kill_first_configure:1:1,{together(2, steps)}"
    groups = start_groups(
        config,
        extra={0: two, 1: [*two, "--max-restarts", "2"]},
        env={0: {"PARATRAIN_FAULT": alone}, 1: {"PARATRAIN_FAULT": dies_twice}},
    )
    healthy_log, healed_log = finish(groups)
    assert healed_log.count("exitcode: -9") == 2 and "healed from a live replica group" in healed_log
    assert "did not all connect within parallel.fault_tolerance.rendezvous_timeout_s=2 s" in healthy_log
    assert_group_0_stepped_once_each_step_and_ends_as_group_1(tmp_path, steps, pause_below=timeout_s / 2)


def test_groups_that_a_preemption_finds_in_their_commit_votes_still_stop_together_and_save(tmp_path, steady_lighthouse):
    """The stuck-vote watch must not take a preemption for a dead rank: every rank of two groups of two processes
    gets SIGTERM just before its commit vote of step 6. Every rank is alive, so each vote closes at once and
    the groups stop at a step boundary with exit code 75 and a checkpoint, as preempted plain runs do."""
    preempted = "sigterm_before_vote:6"
    _, groups = start_two_process_groups(tmp_path, steady_lighthouse, steps=12, faults={0: preempted, 1: preempted})
    for index, group in enumerate(groups):
        code, output = group.process.wait(timeout=400), group.log.read_text()
        assert code == EXIT_REQUEUE, f"group {index} ended with {code}:\n{output[-4000:]}"
        assert "commit vote, still open" not in output
    saved = [sorted(path.name for path in (tmp_path / f"ft/replica-group-{g}/checkpoints").iterdir()) for g in (0, 1)]
    assert saved[0] == saved[1] and saved[0][-1] in ("step-6", "step-7"), saved


def test_a_stop_signal_that_reaches_one_group_stops_every_group_at_the_same_step(tmp_path, steady_lighthouse):
    """Signals reach replica groups at different moments (one Slurm job's groups stopped a step apart, and the one
    behind then healed past the step the other took alone). Here only group 0 gets SIGTERM, after step 4: its
    ranks agree on it at step 5's boundary, and its vote in step 6's all-reduce stops both groups after step 6."""
    ft = {"lighthouse": steady_lighthouse, "quorum_timeout_s": QUORUM_TIMEOUT_S}
    sections = {"parallel": {"fault_tolerance": ft}, "train": {"max_steps": 12}}
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "ft", **sections))
    groups = start_groups(config, env={0: {"PARATRAIN_FAULT": "sigterm_after_step:4"}})
    for index, group in enumerate(groups):
        code, output = group.process.wait(timeout=400), group.log.read_text()
        assert code == EXIT_REQUEUE, f"group {index} ended with {code}:\n{output[-4000:]}"
        assert "stopping at step 6 on SIGTERM" in output
    saved = [sorted(path.name for path in (tmp_path / f"ft/replica-group-{g}/checkpoints").iterdir()) for g in (0, 1)]
    assert saved == [["step-6"], ["step-6"]]


def wait_for_step(output_dir: Path, step: int, groups: list[Group]) -> None:
    """Returns once ``output_dir`` logged ``step`` (bounded; every group must still be running)."""
    deadline = time.monotonic() + 400
    metrics = output_dir / "metrics.jsonl"
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= step):
        for index, group in enumerate(groups):
            code = group.process.poll()
            assert code is None, f"group {index} ended ({code}) before step {step}:\n{group.log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"step {step} not reached"
        time.sleep(0.1)


def test_groups_ride_out_a_restarted_lighthouse_stop_with_75_when_it_stays_away_and_resume_with_nothing_lost(
    tmp_path,
):
    """The lighthouse is killed after step 5 and started again at once: the groups carry on (where their
    quorum request failed meanwhile, after quorum_timeout_s, they ask again). Killed again after step 15 and left dead: past
    lighthouse_wait_s both groups stop with exit code 75. A new lighthouse, the same commands again: they
    resume from their checkpoints and end where an undisturbed run ends, every logged loss equal to it."""
    steps, port = 30, restartable_loopback_port()
    ft = {"lighthouse": f"http://127.0.0.1:{port}", "quorum_timeout_s": 10, "lighthouse_wait_s": 30}
    sections = {"parallel": {"fault_tolerance": ft}, "train": {"max_steps": steps}, "checkpoint": {"every_steps": 5}}
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "ft", **sections))
    server = start_lighthouse(port, tmp_path / "lighthouse-1.log", heartbeat_timeout_s=STEADY_HEARTBEAT_TIMEOUT_S)
    # Time to act between steps; and neither group steps without the other (the new lighthouse may hear one
    # group's quorum request before the other's heartbeat, and would leave that group out).
    slow = {group: {"PARATRAIN_FAULT": f"slow_step:1-{steps},{together(2, steps)}"} for group in range(2)}
    groups, group_0 = start_groups(config, env=slow), tmp_path / "ft/replica-group-0"
    wait_for_step(group_0, 5, groups)
    server.kill()
    # Until the killed lighthouse is gone it still answers on the port, which the new one cannot bind yet: a
    # new one started at once could be taken for running on the old one's answer, leaving none (the likely
    # cause of a CI run in which a group stopped, exit 75, before step 15).
    server.wait(timeout=30)
    server = start_lighthouse(port, tmp_path / "lighthouse-2.log", heartbeat_timeout_s=STEADY_HEARTBEAT_TIMEOUT_S)
    wait_for_step(group_0, 15, groups)
    server.kill()
    server.wait(timeout=30)
    stopped = [group.process.wait(timeout=400) for group in groups]
    logs = [group.log.read_text() for group in groups]
    assert stopped == [75, 75], logs[0][-3000:]
    for log in logs:
        # The first outage, ridden out: unseen where the new lighthouse answered the groups' pending request,
        # or seen and asked again. Either way both groups trained on to step 15 together.
        first_outage = log.split("step 15/", 1)[0]
        assert "no quorum for step" not in first_outage or "formed again after" in first_outage
        assert f"the lighthouse at http://127.0.0.1:{port} does not answer" in log and "exit code 75" in log
    server = start_lighthouse(port, tmp_path / "lighthouse-3.log", heartbeat_timeout_s=STEADY_HEARTBEAT_TIMEOUT_S)
    try:
        finish(start_groups(config))
    finally:
        server.terminate()
        server.wait(timeout=30)
    single = tmp_path / "single"
    train(config, f"run.output_dir={single}")
    reference = losses_by_step(single)
    for group in (group_0, tmp_path / "ft/replica-group-1"):
        records = read_metrics(group)
        assert {record["step"] for record in records} == set(range(1, steps + 1))
        # Steps after the newest checkpoint were trained twice, the same both times.
        assert max(abs(r["loss"] - reference[r["step"]]) / reference[r["step"]] for r in records) <= 1e-5
        final = f"checkpoints/step-{steps}"
        assert max_weight_difference(checkpoint_weights(group / final), checkpoint_weights(single / final)) <= 1e-5


def test_a_group_killed_while_it_heals_costs_the_live_group_a_retaken_step_and_heals_on_its_next_try(
    tmp_path, lighthouse
):
    """Group 1 dies after step 5 and is started again; that start is killed as it heals (a peer's state
    received, not yet applied), and torchrun's restart of it heals. Group 0, alone meanwhile, computes both
    slices: the run still trains as one process does undisturbed."""
    steps = 30
    ft = {"lighthouse": lighthouse, "quorum_timeout_s": QUORUM_TIMEOUT_S}
    ft["rendezvous_timeout_s"] = STEADY_RENDEZVOUS_TIMEOUT_S
    config = write_config(
        tmp_path / "c.yaml", tiny_config(tmp_path / "ft", parallel={"fault_tolerance": ft}, train={"max_steps": steps})
    )
    alone = {"PARATRAIN_FAULT": f"{reaches_its_kill_point(5)},slow_step:6-{steps},{together(25, steps)}"}
    # Group 1 never steps without group 0, which is alive throughout: the healthy group takes every step.
    dies = {"PARATRAIN_FAULT": f"{together(2, steps)},after_step:5"}
    groups = start_groups(config, env={0: alone, 1: dies})
    assert groups[1].process.wait(timeout=400) != 0, "group 1 was to be killed after step 5"
    wait_for_step(tmp_path / "ft/replica-group-0", 6, groups[:1])  # group 0 steps alone before group 1 is back
    dies_healing = {"PARATRAIN_FAULT": f"mid_heal:6-{steps},{together(2, steps)}"}
    groups[1] = start_group(config, 1, extra=["--max-restarts", "1"], env=dies_healing)
    healthy_log, healed_log = finish(groups)
    assert "exitcode: -9" in healed_log and "healed from a live replica group" in healed_log
    assert healthy_log.count("not committed") == 1  # the step group 1 died in; its heal cost none
    single = tmp_path / "single"
    train(config, f"run.output_dir={single}")
    reference, healthy = losses_by_step(single), tmp_path / "ft/replica-group-0"
    records = read_metrics(healthy)
    assert [record["step"] for record in records] == list(range(1, steps + 1))  # each step committed once
    assert max_relative_difference(losses_by_step(healthy), reference) <= 1e-5
    assert {record["skipped_samples"] for record in records} == {0}
    final = f"checkpoints/step-{steps}"
    for group in (healthy, tmp_path / "ft/replica-group-1"):
        assert max_weight_difference(checkpoint_weights(group / final), checkpoint_weights(single / final)) <= 1e-5


def test_every_group_restarted_from_checkpoints_of_different_steps_trains_exactly_as_an_undisturbed_run(
    tmp_path, lighthouse
):
    """Every group down at once, one with a checkpoint and one without: group 1 dies after step 3 (before
    the first checkpoint), group 0 trains on alone, computing both slices, and dies after step 12 (its newest
    checkpoint: step 10). Both started again: group 0 resumes at step 10, group 1 heals from it (its fresh
    optimizer receiving every moment), and the run trains on as one process does undisturbed, no step of it
    waiting out a failed all-reduce."""
    steps = 20
    ft = {"lighthouse": lighthouse, "quorum_timeout_s": QUORUM_TIMEOUT_S}
    ft["rendezvous_timeout_s"] = STEADY_RENDEZVOUS_TIMEOUT_S
    sections = {"parallel": {"fault_tolerance": ft}, "train": {"max_steps": steps}, "checkpoint": {"every_steps": 5}}
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "ft", **sections))
    faults = {
        0: {"PARATRAIN_FAULT": f"{reaches_its_kill_point(3)},after_step:12"},
        1: {"PARATRAIN_FAULT": "after_step:3"},
    }
    groups = start_groups(config, env=faults)
    assert [group.process.wait(timeout=400) != 0 for group in groups] == [True, True], "both were to be killed"
    logs = finish(start_groups(config))
    assert "resumed from" in logs[0] and "step 10" in logs[0]
    assert "healed from a live replica group" in logs[1] and "not committed" not in logs[1]
    single = tmp_path / "single"
    train(config, f"run.output_dir={single}")
    reference = losses_by_step(single)
    final = f"checkpoints/step-{steps}"
    for group in (tmp_path / "ft/replica-group-0", tmp_path / "ft/replica-group-1"):
        records = read_metrics(group)
        assert max(abs(r["loss"] - reference[r["step"]]) / reference[r["step"]] for r in records) <= 1e-5
        assert max_weight_difference(checkpoint_weights(group / final), checkpoint_weights(single / final)) <= 1e-5
