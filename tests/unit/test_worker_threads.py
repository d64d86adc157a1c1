"""torchrun's one OpenMP thread per worker, set by the CLI before it imports torch (launch/worker_threads.py)."""

from __future__ import annotations

import os

import pytest

from paratrain.launch.worker_threads import THREADS_VARIABLE, apply_torchruns_thread_default


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "c.yaml", "--nproc-per-node", "2"],
        ["train", "c.yaml", "--nproc-per-node=4", "train.max_steps=5"],
    ],
)
def test_several_workers_on_a_node_get_one_thread_each_as_torchrun_gives_them(argv, monkeypatch, capsys):
    monkeypatch.delenv(THREADS_VARIABLE, raising=False)
    apply_torchruns_thread_default(argv)
    assert os.environ[THREADS_VARIABLE] == "1"
    assert f"{THREADS_VARIABLE}=1 in each worker" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "c.yaml"],  # one process: torchrun leaves it unset too
        ["train", "c.yaml", "--nproc-per-node", "1"],
        ["train", "c.yaml", "--nproc-per-node", "two"],  # the parser names the error later
        ["check", "c.yaml", "--nproc-per-node", "2"],  # not a training launch
        [],
    ],
)
def test_one_process_other_commands_and_bad_values_leave_it_unset(argv, monkeypatch, capsys):
    monkeypatch.delenv(THREADS_VARIABLE, raising=False)
    apply_torchruns_thread_default(argv)
    assert THREADS_VARIABLE not in os.environ
    assert capsys.readouterr().err == ""


def test_a_users_own_value_is_kept(monkeypatch, capsys):
    monkeypatch.setenv(THREADS_VARIABLE, "3")
    apply_torchruns_thread_default(["train", "c.yaml", "--nproc-per-node", "2"])
    assert os.environ[THREADS_VARIABLE] == "3"
    assert capsys.readouterr().err == ""
