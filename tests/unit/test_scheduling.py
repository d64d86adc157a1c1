"""The suite's own scheduling (tests/scheduling.py): which worker is given which test file next."""

from __future__ import annotations

import os
from collections import OrderedDict

from tests.scheduling import WAITING_FILES, WaitingLaneScheduling

COMPUTING = ["tests/parity/test_a.py", "tests/unit/test_b.py"]


def scheduler_with(workers: int, queue: list[str]) -> WaitingLaneScheduling:
    """The scheduler's choice alone: its queue of files and its workers (stand-ins, compared by identity)."""
    scheduler = WaitingLaneScheduling.__new__(WaitingLaneScheduling)
    scheduler.workqueue = OrderedDict((scope, {}) for scope in queue)
    scheduler.assigned_work = {object(): {} for _ in range(workers)}
    return scheduler


def test_with_a_worker_more_than_cores_the_last_takes_waiting_files_and_the_others_the_rest():
    cores = len(os.sched_getaffinity(0))
    queue = [COMPUTING[0], WAITING_FILES[1], COMPUTING[1], WAITING_FILES[0]]
    scheduler = scheduler_with(cores + 1, queue)
    *computing, lane = scheduler.nodes
    assert scheduler._next_scope(lane) == WAITING_FILES[0]  # the longest first
    assert all(scheduler._next_scope(node) == COMPUTING[0] for node in computing)


def test_a_lane_out_of_its_own_files_takes_the_queues_next():
    cores = len(os.sched_getaffinity(0))
    scheduler = scheduler_with(cores + 1, [WAITING_FILES[2], *COMPUTING])
    assert scheduler._next_scope(scheduler.nodes[0]) == COMPUTING[0]
    scheduler = scheduler_with(cores + 1, [WAITING_FILES[2]])
    assert scheduler._next_scope(scheduler.nodes[0]) == WAITING_FILES[2]
    scheduler = scheduler_with(cores + 1, COMPUTING)
    assert scheduler._next_scope(scheduler.nodes[-1]) == COMPUTING[0]


def test_with_a_worker_per_core_or_fewer_the_queue_keeps_its_order():
    queue = [COMPUTING[0], WAITING_FILES[0]]
    scheduler = scheduler_with(len(os.sched_getaffinity(0)), queue)
    assert [scheduler._next_scope(node) for node in scheduler.nodes] == [COMPUTING[0]] * len(scheduler.nodes)
