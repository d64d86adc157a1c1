from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import torch

from paratrain.errors import EXIT_REQUEUE, EXIT_SAVE_FAILED
from paratrain.launch.launcher import _summarise_failure
from paratrain.launch.preemption import StopSignals, _parent_of, _started_by, stop_vote, voted_stop


def test_a_stop_signal_is_acted_on_at_the_boundary_after_the_one_that_reduced_it():
    previous = signal.getsignal(signal.SIGUSR1)
    stop = StopSignals.install(torch.device("cpu"))
    try:
        assert stop.agreed_signal() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.agreed_signal() is None  # reduced now, read at the next boundary
        assert stop.agreed_signal() == signal.SIGUSR1
        assert stop.received_name == "SIGUSR1"
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is previous


def test_a_replica_group_votes_for_the_signal_its_ranks_agreed_on_and_every_group_acts_on_the_first_voted():
    stop = StopSignals.install(torch.device("cpu"))
    try:
        assert stop_vote(torch.device("cpu")).tolist() == [0.0, 0.0]
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop_vote(torch.device("cpu")).tolist() == [0.0, 0.0]  # received, not yet reduced by the group
        assert stop.agreed_signal() is None  # reduced at this boundary: the next step's vote carries it
        assert stop_vote(torch.device("cpu")).tolist() == [0.0, 1.0]
        assert stop.agreed_signal() == signal.SIGUSR1  # the vote started no reduction: the boundary reads the same
    finally:
        stop.uninstall()
    assert voted_stop([0.0, 0.0]) is None
    assert voted_stop([0.0, 0.5]) == signal.SIGUSR1  # one group of two voted (the sum is divided by the groups)
    assert voted_stop([0.5, 0.5]) == signal.SIGTERM  # groups that voted for different signals act on one alike


def test_launcher_exits_with_the_requeue_code_only_when_every_worker_did(capsys):
    def failure(*codes: int) -> SimpleNamespace:
        return SimpleNamespace(failures={rank: SimpleNamespace(exitcode=code) for rank, code in enumerate(codes)})

    assert _summarise_failure(failure(EXIT_REQUEUE, EXIT_REQUEUE)) == EXIT_REQUEUE
    assert "every worker stopped for a requeue" in capsys.readouterr().err
    assert _summarise_failure(failure(1, EXIT_REQUEUE)) == 1


def test_launcher_exits_74_when_workers_stopped_on_a_refused_save_and_torchrun_stopped_the_rest(capsys):
    def failure(*codes: int) -> SimpleNamespace:
        return SimpleNamespace(failures={rank: SimpleNamespace(exitcode=code) for rank, code in enumerate(codes)})

    # Rank 0 still closing its process group when rank 1 exited: torchrun stopped it with SIGTERM.
    assert _summarise_failure(failure(-signal.SIGTERM, EXIT_SAVE_FAILED)) == EXIT_SAVE_FAILED
    assert capsys.readouterr().err == ""  # rank 0 already said what failed and what is safe
    assert _summarise_failure(failure(-signal.SIGTERM, -signal.SIGTERM)) == 128 + signal.SIGTERM
    assert _summarise_failure(failure(1, EXIT_SAVE_FAILED)) == 1


def test_the_stop_notice_goes_to_a_launcher_that_started_this_process_itself_or_through_a_fork_server():
    """A GPU build's workers are the launcher's children; a CPU build's, its fork server's (launch/forked_workers.py)."""
    parent = os.getppid()
    grandparent = _parent_of(parent)
    assert grandparent is not None and grandparent != parent
    assert _started_by(parent) and _started_by(grandparent)
    assert not _started_by(os.getpid())  # a variable inherited from a launcher further up names no parent
