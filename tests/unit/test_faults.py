"""Fault injection's attempts: a kill-style fault fires in torchrun's first attempt only (so a restart can be
shown to recover), while ``wait_for_groups``, a fixed point and not a failure, holds in every attempt."""

from __future__ import annotations

import pytest

from paratrain.launch import faults


@pytest.fixture
def attempt(monkeypatch):
    def set_attempt(spec: str, restart_count: int) -> None:
        monkeypatch.setenv(faults.ENV_VAR, spec)
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart_count))

    return set_attempt


def test_a_fixed_point_holds_in_a_restart_where_a_kill_does_not(attempt):
    spec = "wait_for_groups:2-5,after_step:5"
    attempt(spec, restart_count=0)
    assert faults.fires("wait_for_groups", step=3, rank=0)
    assert faults._fires("after_step", step=5, rank=0)
    attempt(spec, restart_count=1)
    assert faults.fires("wait_for_groups", step=3, rank=0)
    assert not faults._fires("after_step", step=5, rank=0)


def test_a_fixed_point_holds_only_at_its_steps_and_rank(attempt):
    attempt("wait_for_groups:2-5:1", restart_count=1)
    assert faults.fires("wait_for_groups", step=5, rank=1)
    assert not faults.fires("wait_for_groups", step=6, rank=1)
    assert not faults.fires("wait_for_groups", step=1, rank=1)
    assert not faults.fires("wait_for_groups", step=3, rank=0)
