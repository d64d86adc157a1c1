"""A check that passed in an earlier attempt of a launch is not run again by torchrun's restart of it
(launch/attempt_memory.py), and only then."""

from __future__ import annotations

import pytest

from paratrain.launch.attempt_memory import passed_in_an_earlier_attempt, record_passed
from paratrain.launch.preemption import LAUNCHER_PID_ENV


def attempt(monkeypatch, *, number: int, launcher: str = "4242", run_id: str = "run-a") -> None:
    """The environment torchrun and paratrain's launcher give a worker of attempt ``number``."""
    monkeypatch.setenv(LAUNCHER_PID_ENV, launcher)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(number))


def test_a_restart_of_the_launch_that_passed_takes_the_check_as_passed(tmp_path, monkeypatch):
    attempt(monkeypatch, number=0)
    assert not passed_in_an_earlier_attempt(tmp_path, check="fit", digest="d1")
    record_passed(tmp_path, check="fit", digest="d1")
    assert not passed_in_an_earlier_attempt(tmp_path, check="fit", digest="d1")  # a first attempt always checks
    attempt(monkeypatch, number=1)
    assert passed_in_an_earlier_attempt(tmp_path, check="fit", digest="d1")
    assert not passed_in_an_earlier_attempt(tmp_path, check="fit", digest="d2")  # other sections
    assert not passed_in_an_earlier_attempt(tmp_path, check="other", digest="d1")


@pytest.mark.parametrize("other", [{"launcher": "4343"}, {"run_id": "run-b"}])
def test_another_launchs_pass_counts_for_nothing(tmp_path, monkeypatch, other):
    attempt(monkeypatch, number=0)
    record_passed(tmp_path, check="fit", digest="d1")
    attempt(monkeypatch, number=1, **other)  # a launch whose first attempt stopped on a ConfigError: no record
    assert not passed_in_an_earlier_attempt(tmp_path, check="fit", digest="d1")


def test_workers_started_without_paratrains_launcher_always_check(tmp_path, monkeypatch):
    attempt(monkeypatch, number=0)
    record_passed(tmp_path, check="fit", digest="d1")
    monkeypatch.delenv(LAUNCHER_PID_ENV)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not passed_in_an_earlier_attempt(tmp_path, check="fit", digest="d1")
    record_passed(tmp_path / "never", check="fit", digest="d1")
    assert not (tmp_path / "never").exists()
