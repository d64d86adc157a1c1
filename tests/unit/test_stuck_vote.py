"""A replica group's rank that a stop signal finds in a vote left open (a rank of its group is dead) ends with
EXIT_GROUP_RESTART once the grace is over; one whose vote closes within the grace carries on to stop at the
step boundary, as a preempted rank must."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from paratrain.errors import EXIT_GROUP_RESTART
from paratrain.launch.stuck_vote import StuckVoteWatch, process_is_gone

# A rank with a stop handler of its own (launch/preemption.py's records the signal and returns), then a vote
# that lasts VOTE_S: the main thread blocks, as in torchft's vote, and the parent signals it meanwhile.
RANK = """
import signal, sys, time
from paratrain.launch.stuck_vote import StuckVoteWatch
signal.signal(signal.SIGTERM, lambda number, frame: None)
siblings = tuple(int(pid) for pid in sys.argv[4:])
watch = StuckVoteWatch.start(grace_s=float(sys.argv[1]), siblings=siblings)
with getattr(watch, sys.argv[3])():
    print("voting", flush=True)
    time.sleep(float(sys.argv[2]))
print("voted", flush=True)
time.sleep(float(sys.argv[1]) + 0.5)  # past the grace, outside any vote: nothing ends it
print("at the step boundary", flush=True)
"""


def start_rank(
    *, grace_s: float, vote_s: float, siblings: tuple[int, ...] = (), inside: str = "voting"
) -> subprocess.Popen:
    """A rank inside the commit vote (``inside="voting"``) or the quorum request (``"asking_for_quorum"``)."""
    argv = [sys.executable, "-c", RANK, str(grace_s), str(vote_s), inside, *map(str, siblings)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_stop_signal_during_a_vote_that_stays_open_ends_the_rank_with_the_group_restart_code():
    rank = start_rank(grace_s=0.5, vote_s=60)
    try:
        assert rank.stdout.readline() == "voting\n"
        rank.send_signal(signal.SIGTERM)
        assert rank.wait(timeout=30) == EXIT_GROUP_RESTART
        assert "commit vote, still open 0.5 s later" in rank.stderr.read()
        assert rank.stdout.read() == ""  # it never left the vote
    finally:
        rank.kill()


@pytest.mark.parametrize(("inside", "where"), [("voting", "commit vote"), ("asking_for_quorum", "quorum request")])
def test_a_stop_signal_ends_the_rank_at_once_where_a_rank_of_its_group_on_this_host_is_gone(inside, where):
    """In the vote, or in the quorum request of a group whose rank was killed between two steps (its request never
    comes)."""
    sibling = subprocess.Popen(["true"])  # exits at once; unwaited, it stays a zombie, as a killed rank does
    while not process_is_gone(sibling.pid):
        time.sleep(0.01)
    rank = start_rank(grace_s=600, vote_s=600, siblings=(sibling.pid,), inside=inside)
    try:
        assert rank.stdout.readline() == "voting\n"
        rank.send_signal(signal.SIGTERM)
        assert rank.wait(timeout=30) == EXIT_GROUP_RESTART  # not the 600 s grace
        assert f"{where}, the group's rank in process {sibling.pid} is gone" in rank.stderr.read()
    finally:
        rank.kill()
        sibling.wait()


def test_a_vote_that_closes_within_the_grace_after_a_stop_signal_lets_the_rank_go_on():
    rank = start_rank(grace_s=3.0, vote_s=0.5, siblings=(os.getpid(),))  # a live rank of the group on this host
    assert_goes_on_to_the_step_boundary_after_a_stop_signal(rank)


def test_a_quorum_request_open_past_the_grace_after_a_stop_signal_lets_the_rank_go_on_while_its_group_lives():
    # A preempted group's quorum may wait on a restarting group: its ranks must still reach the boundary and save.
    rank = start_rank(grace_s=0.2, vote_s=1.5, siblings=(os.getpid(),), inside="asking_for_quorum")
    assert_goes_on_to_the_step_boundary_after_a_stop_signal(rank)


def assert_goes_on_to_the_step_boundary_after_a_stop_signal(rank: subprocess.Popen) -> None:
    try:
        assert rank.stdout.readline() == "voting\n"
        rank.send_signal(signal.SIGTERM)
        out, err = rank.communicate(timeout=30)
        assert rank.returncode == 0, err
        assert out == "voted\nat the step boundary\n"
    finally:
        rank.kill()


def test_a_process_is_gone_once_it_exited_whether_or_not_its_parent_reaped_it():
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert not process_is_gone(child.pid)
        assert not process_is_gone(os.getpid())
    finally:
        child.kill()
    deadline = time.monotonic() + 30
    while not process_is_gone(child.pid):  # a zombie until waited for
        assert time.monotonic() < deadline
        time.sleep(0.01)
    child.wait()
    assert process_is_gone(child.pid)


def test_closing_the_watch_gives_the_wakeup_fd_back():
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd)  # someone else's, before the watch
    try:
        watch = StuckVoteWatch.start(grace_s=1.0)
        watch.close()
        watch.close()  # twice, as at exit after the group closed it
        assert signal.set_wakeup_fd(write_fd) == write_fd
    finally:
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
