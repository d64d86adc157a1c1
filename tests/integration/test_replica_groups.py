"""Fault-tolerant replica groups on torchft, through the real CLI: a loopback lighthouse (`paratrain
lighthouse`), each group its own `paratrain train --replica-group I --replica-groups 2` (its own torchrun).

Without a failure, two groups of one process train exactly as DDP over two processes. With one (a group's
worker SIGKILLed, torchrun restarting it), the other group keeps stepping, the restarted group heals from it
(no checkpoint read) and both end with the same weights.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness import (
    checkpoint_weights,
    free_loopback_port,
    losses_by_step,
    max_relative_difference,
    max_weight_difference,
    read_metrics,
    start_cli,
    tiny_config,
    train,
    write_config,
)

pytest.importorskip("torchft", reason="replica groups need the ft extra: pip install 'paratrain[ft]'")

STEPS = 20


# A loaded machine can starve a group for long stretches: the lighthouse waits for a live group's quorum
# request for up to JOIN_TIMEOUT_S (a dead one is left out after a second without heartbeats), and every
# group waits for the quorum longer than that, so no test passes or fails by the machine's speed.
JOIN_TIMEOUT_S = 300
QUORUM_TIMEOUT_S = JOIN_TIMEOUT_S + 60


@pytest.fixture
def lighthouse():
    """A lighthouse on a free loopback port: its address. It forgets a silent group after 1 s."""
    port = free_loopback_port()
    server = start_cli(
        [
            "lighthouse", "--bind", f"127.0.0.1:{port}", "--heartbeat-timeout-ms", "1000",
            "--join-timeout-ms", str(JOIN_TIMEOUT_S * 1000),
        ]
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert server.poll() is None, server.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the lighthouse did not start"
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}"
    server.terminate()
    server.communicate(timeout=30)


def start_groups(
    config: Path, *, extra: dict[int, list[str]] | None = None, env: dict[int, dict[str, str]] | None = None
):
    extra, env = extra or {}, env or {}
    return [
        start_cli(
            ["train", str(config), "--replica-group", str(group), "--replica-groups", "2", *extra.get(group, [])],
            env=env.get(group),
        )
        for group in range(2)
    ]


def finish(groups: list[subprocess.Popen]) -> list[str]:
    """Each group's stderr, once every group exited 0."""
    outputs = [group.communicate(timeout=400) for group in groups]
    for index, (group, (_, stderr)) in enumerate(zip(groups, outputs)):
        assert group.returncode == 0, f"group {index} failed ({group.returncode}):\n{stderr[-4000:]}"
    return [stderr for _, stderr in outputs]


def test_two_replica_groups_without_failure_train_exactly_as_ddp_over_two_processes(tmp_path, lighthouse):
    parallel = {"fault_tolerance": {"lighthouse": lighthouse, "quorum_timeout_s": QUORUM_TIMEOUT_S}}
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


def test_a_killed_group_heals_from_its_live_peer_while_the_peer_keeps_stepping(tmp_path, lighthouse):
    steps, killed_after, back_by = 40, 5, 30
    parallel = {"fault_tolerance": {"lighthouse": lighthouse, "quorum_timeout_s": QUORUM_TIMEOUT_S}}
    config = write_config(
        tmp_path / "c.yaml", tiny_config(tmp_path / "ft", parallel=parallel, train={"max_steps": steps})
    )
    # Group 0 takes half a second a step while group 1 is away, and at step 30 waits for it to be back: however
    # slow torchrun's restart of group 1 is on this machine, group 1 heals from a group still training.
    slow_alone = f"slow_step:{killed_after + 1}-{steps},wait_for_groups:{back_by}"
    groups = start_groups(
        config,
        extra={1: ["--max-restarts", "1"]},
        env={0: {"PARATRAIN_FAULT": slow_alone}, 1: {"PARATRAIN_FAULT": f"after_step:{killed_after}"}},
    )
    healthy_log, healed_log = finish(groups)
    healthy, healed = tmp_path / "ft/replica-group-0", tmp_path / "ft/replica-group-1"
    assert "healed from a live replica group" in healed_log and "resumed from" not in healed_log
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
